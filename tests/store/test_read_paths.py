"""Fast read and write paths: `pointer_history(last=n)`, `attempt_facts`, unsynced and non-blocking span
writes (`add_spans(sync=False)`, `try_add_spans`), each equal in result to the general path."""

from __future__ import annotations

import sqlite3
import time

import pytest

from lightning_dagster.store import Store
from lightning_dagster.store.errors import InvalidInput, NotFound
from lightning_dagster.types import AttemptState, Rollout, RolloutKind, Span, SpanKind


def test_pointer_history_last_is_the_tail_of_the_full_history(store: Store) -> None:
    expected = None
    for i in range(5):
        store.move_pointer("p", expected=expected, to=f"v{i}", actor="t")
        expected = f"v{i}"
    store.move_pointer("other", expected=None, to="x", actor="t")  # another pointer's moves never leak in
    full = store.pointer_history("p")
    assert [m.to_value for m in full] == [f"v{i}" for i in range(5)]
    assert store.pointer_history("p", last=1) == full[-1:]
    assert store.pointer_history("p", last=3) == full[-3:]
    assert store.pointer_history("p", last=50) == full
    assert store.pointer_history("p", last=0) == []
    assert store.pointer_history("never-set", last=1) == []
    assert store.current_pointer("p") == "v4"
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(InvalidInput):
            store.pointer_history("p", last=bad)


def _spans(rollout_id: str, attempt_id: str, turns: int) -> list[Span]:
    """A conversation whose prompts extend the previous prompt + response, as a chat template's do."""
    prompt, out = list(range(1, 301)), []
    for turn in range(turns):
        response = [1000 + 50 * turn + i for i in range(50)]
        out.append(
            Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence=turn,
                name="chat",
                kind=SpanKind.llm,
                prompt_token_ids=prompt,
                response_token_ids=response,
                response_logprobs=[-0.125 * (i % 8) for i in range(50)],
            )
        )
        prompt = prompt + response + [7, 8, 9]
    return out


def test_attempt_facts_is_one_read_of_what_a_gateway_needs(store: Store) -> None:
    (rollout,) = store.enqueue_rollouts([Rollout(metadata={"sampling_seed": 3}, harness="h")])
    _, attempt = store.claim_rollout("w")
    rid, state, kind, metadata, highest, harness = store.attempt_facts(attempt.attempt_id)
    assert (rid, state, kind, metadata, highest, harness) == (
        rollout.rollout_id,
        AttemptState.running,
        RolloutKind.train,
        {"sampling_seed": 3},
        None,
        "h",
    )
    store.add_spans(_spans(rid, attempt.attempt_id, 2))
    assert store.attempt_facts(attempt.attempt_id)[4] == 1
    with pytest.raises(NotFound):
        store.attempt_facts("no-such-attempt")


def test_unsynced_and_nonblocking_writes_store_the_same_exact_spans(store: Store, store_url: str) -> None:
    (rollout,) = store.enqueue_rollouts([Rollout()])
    _, attempt = store.claim_rollout("w")
    rid, aid = rollout.rollout_id, attempt.attempt_id
    spans = _spans(rid, aid, 6)
    fresh = Store(store_url)  # a Store that has never seen the attempt must look it up: no non-blocking write
    try:
        assert fresh.try_add_spans(spans[:1]) is False
        assert store.count_spans(attempt_id=aid) == 0
    finally:
        fresh.close()
    store.add_spans(spans[:2], sync=False)
    written = 2
    for span in spans[2:]:
        if not store.try_add_spans([span], sync=False):  # refused: nothing written, the blocking path does it
            store.add_spans([span], sync=False)
        written += 1
        assert store.count_spans(attempt_id=aid) == written
    assert store.list_spans(attempt_id=aid) == spans
    stranger = spans[0].model_copy(update={"attempt_id": "nope", "span_id": "s-x"})
    assert store.try_add_spans([stranger]) is False  # an unchecked pair is left to the blocking path...
    with pytest.raises(NotFound):  # ... which refuses it
        store.add_spans([stranger])
    assert store.count_spans(rollout_id=rid) == len(spans)


def test_a_nonblocking_write_never_waits_for_another_writer(store: Store, store_url: str) -> None:
    if not store_url.startswith("sqlite"):
        pytest.skip("non-blocking writes are a SQLite fast path; elsewhere try_add_spans returns False")
    (rollout,) = store.enqueue_rollouts([Rollout()])
    _, attempt = store.claim_rollout("w")
    spans = _spans(rollout.rollout_id, attempt.attempt_id, 70)
    store.add_spans(spans[:1])
    other = sqlite3.connect(store.engine.url.database, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        t0 = time.monotonic()
        assert store.try_add_spans(spans[1:2], sync=False) is False
        assert time.monotonic() - t0 < 1.0
    finally:
        other.execute("ROLLBACK")
        other.close()
    taken = [store.try_add_spans([s], sync=False) for s in spans[1:]]
    assert taken.count(False) >= 1  # a WAL checkpoint is periodically left to the blocking path
    assert taken.count(True) >= 60
    for span, done in zip(spans[1:], taken, strict=True):
        if not done:
            store.add_spans([span])
    assert store.list_spans(attempt_id=attempt.attempt_id) == sorted(spans, key=lambda s: s.sequence)


@pytest.mark.parametrize("n", [0, 1, 32, 33, 300])
def test_an_id_list_of_any_length_selects_exactly_those_rollouts_and_attempts(store: Store, n: int) -> None:
    """Lists over 32 ids are bound as one JSON array (`Connection._ids_in`); the answers are the same."""
    made = store.enqueue_rollouts([Rollout() for _ in range(n + 20)])
    wanted = [r.rollout_id for r in made[:n]]
    asked = [*wanted, *wanted[:3], "no-such-rollout", "quote'\"\\id", "\u00e9\u4e2d"]  # repeats, strangers
    assert {r.rollout_id for r in store.query_rollouts(rollout_ids=asked)} == set(wanted)
    assert store.count_rollouts(rollout_ids=asked) == n
    claimed = [store.claim_rollout("w", rollout_ids=asked) for _ in range(min(n, 40))]
    assert {r.rollout_id for r, _ in claimed} <= set(wanted)
    strangers = asked[n + min(n, 3) :]
    assert len(strangers) == 3 and store.claim_rollout("w", rollout_ids=strangers * 20) is None
    attempts = store.list_attempts(rollout_ids=asked)
    assert sorted(a.attempt_id for a in attempts) == sorted(a.attempt_id for _, a in claimed)
    assert store.count_rollouts(rollout_ids=asked, status="queued") == n - len(claimed)


def test_nonblocking_creates_leave_a_checkpoint_to_the_blocking_path_so_the_wal_stays_bounded(
    store: Store, store_url: str
) -> None:
    """Agent Lightning's creates commit on the gateway's event loop with `nowait` (a connection that never
    checkpoints): every so often one is refused, nothing written, and made by the blocking path, whose
    commit checkpoints; with only creates coming in, the WAL is reused instead of growing for ever."""
    if not store_url.startswith("sqlite"):
        pytest.skip("non-blocking writes are a SQLite fast path")
    from pathlib import Path

    from lightning_dagster.store import agl_rollouts as store_agl
    from lightning_dagster.types import Sampling

    def one(i: int) -> Rollout:
        return store_agl.new_rollout(f"c{i}", {"input": {"q": "x" * 200}, "metadata": {}}, Sampling())

    refused = 0
    for i in range(1500):
        made = store_agl.create(store, [one(i)], nowait=True)
        if made is None:  # refused: the caller's blocking path creates it
            refused += 1
            made = store_agl.create(store, [one(i)])
        assert [r.rollout_id for r in made] == [f"c{i}"]
    assert 1500 // 64 <= refused <= 1500 // 64 + 1
    wal = Path(store.engine.url.database + "-wal")
    assert wal.stat().st_size < 16 << 20  # ~10 KB a create: 15 MB had nothing checkpointed
    assert store.count_rollouts() == 1500
    assert store_agl.create(store, [one(7)], nowait=True) in (None, [store_agl.get(store, "c7")])
