"""Span ingest: exact token round-trip with prefix sharing, compact storage, and all-or-nothing batches."""

from __future__ import annotations

import json
import random
import struct

import pydantic
import pytest
import sqlalchemy as sa

from lightning_dagster.store import Conflict, InvalidInput, NotFound, Store
from lightning_dagster.store.agl_rollouts import span_marker
from lightning_dagster.store.schema import spans as spans_table
from lightning_dagster.types import Rollout, Span, SpanKind


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _claimed(store: Store, n: int = 1):
    store.enqueue_rollouts([Rollout(task_id=str(i)) for i in range(n)])
    return [store.claim_rollout("w") for _ in range(n)]


def _conversation(rollout_id: str, attempt_id: str, turns: int, prompt_len: int, seed: int = 0) -> list[Span]:
    """A multi-turn LLM conversation: each prompt is the previous prompt + response + a tool result."""
    rng = random.Random(seed)
    prompt = [rng.randrange(50_000) for _ in range(prompt_len)]
    spans = []
    for turn in range(turns):
        response = [rng.randrange(50_000) for _ in range(rng.randrange(20, 40))]
        spans.append(
            Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence=2 * turn,
                name="chat",
                kind=SpanKind.llm,
                prompt_token_ids=prompt,
                response_token_ids=response,
                response_logprobs=[_f32(-rng.random() * 5) for _ in response],
                finish_reason="stop",
                attributes={"token_in": turn > 0},
            )
        )
        spans.append(
            Span(
                rollout_id=rollout_id, attempt_id=attempt_id, sequence=2 * turn + 1, name="calc", kind="tool"
            )
        )
        prompt = prompt + response + [rng.randrange(50_000) for _ in range(15)]
    return spans


def test_tokens_round_trip_exactly_with_prefix_sharing_and_divergence(store, store_url):
    (rollout, attempt), (other, other_attempt) = _claimed(store, 2)
    spans = _conversation(rollout.rollout_id, attempt.attempt_id, turns=4, prompt_len=300)
    last = spans[-2]
    context = last.prompt_token_ids + last.response_token_ids
    extra = [
        # a re-rendered history that diverges mid-way (does NOT extend the previous call)
        Span(rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id, sequence=8, kind="llm",
             prompt_token_ids=context[:250] + [7, 7, 7], response_token_ids=[], response_logprobs=[]),
        # nothing in common with the previous call, then an empty prompt, then no tokens at all
        Span(rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id, sequence=9, kind="llm",
             prompt_token_ids=[99_999, 2**31 - 1, 0], response_token_ids=[1], response_logprobs=[-0.5]),
        Span(rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id, sequence=10, kind="llm",
             prompt_token_ids=[], response_token_ids=None, response_logprobs=None),
        Span(rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id, sequence=11, kind="llm",
             prompt_token_ids=[5, 6], response_token_ids=[7]),
    ]  # fmt: skip
    other_spans = _conversation(other.rollout_id, other_attempt.attempt_id, turns=2, prompt_len=50, seed=1)
    store.add_spans(spans[:3])  # batches split mid-conversation, interleaved with another attempt
    store.add_spans(other_spans[:2] + spans[3:6])
    fresh = Store(store_url)  # no cached contexts: must rebuild the chain from the database
    fresh.add_spans(spans[6:] + extra[:2] + other_spans[2:])
    store.add_spans(extra[2:])

    for reader in (store, fresh):
        assert reader.list_spans(rollout_id=rollout.rollout_id) == spans + extra
        assert reader.list_spans(attempt_id=other_attempt.attempt_id) == other_spans
    llm = [s for s in spans + extra if s.kind is SpanKind.llm]
    assert store.list_spans(rollout_ids=[rollout.rollout_id], kind="llm") == llm
    assert store.count_spans(rollout_ids=[rollout.rollout_id], kind=SpanKind.tool) == 4
    assert store.count_spans() == len(spans + extra + other_spans)
    assert span_marker(store, attempt.attempt_id)[1] == 11  # the highest sequence
    assert span_marker(store, "at-none") == (0, None)

    with store.engine.connect() as c:
        rows = {
            r.span_id: r
            for r in c.execute(sa.select(spans_table).where(spans_table.c.attempt_id == attempt.attempt_id))
        }
    turns = [s for s in spans if s.kind is SpanKind.llm]
    for before, after in zip(turns, turns[1:], strict=False):  # each turn stores only the 15 tokens it adds
        row = rows[after.span_id]
        assert row.prompt_ref == before.span_id
        assert row.prompt_shared == len(before.prompt_token_ids) + len(before.response_token_ids)
        assert len(row.prompt_tail) == 15 * 4
    diverged = rows[extra[0].span_id]
    assert (diverged.prompt_ref, diverged.prompt_shared, len(diverged.prompt_tail)) == (
        turns[-1].span_id,
        250,
        12,
    )
    assert rows[extra[1].span_id].prompt_ref is None and rows[extra[1].span_id].prompt_shared == 0
    assert rows[extra[3].span_id].prompt_tail == struct.pack("<2i", 5, 6)  # little-endian int32
    fresh.close()


def test_logprobs_are_float32(store):
    ((rollout, attempt),) = _claimed(store)
    x = -0.123456789012345  # not representable in float32: comes back as its nearest float32
    store.add_spans([Span(rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id, kind="llm",
                          prompt_token_ids=[1], response_token_ids=[2], response_logprobs=[x])])  # fmt: skip
    (got,) = store.list_spans(attempt_id=attempt.attempt_id)
    assert got.response_logprobs == [_f32(x)] and got.response_logprobs != [x]
    assert abs(got.response_logprobs[0] - x) < 1e-7


def test_ten_turns_of_1k_token_prompts_cost_far_less_than_ten_prompts(store):
    ((rollout, attempt),) = _claimed(store)
    spans = [s for s in _conversation(rollout.rollout_id, attempt.attempt_id, turns=10, prompt_len=1000)]
    store.add_spans(spans)
    naive = sum(
        len(json.dumps([s.prompt_token_ids, s.response_token_ids, s.response_logprobs]))
        for s in spans
        if s.kind is SpanKind.llm
    )
    t = spans_table.c
    parts = [t.prompt_tail, t.response_ids, t.response_logprobs, t.prompt_ref]
    with store.engine.connect() as c:
        stored = c.execute(
            sa.select(sa.func.sum(sum(sa.func.coalesce(sa.func.length(p), 0) for p in parts)))
        ).scalar()
    ten_prompts_int32 = 4 * sum(len(s.prompt_token_ids) for s in spans if s.kind is SpanKind.llm)
    assert stored < ten_prompts_int32 / 5  # the first prompt once, then only what each turn adds
    assert stored < naive / 10  # measured: ~1/12.7
    assert store.list_spans(attempt_id=attempt.attempt_id) == spans


def test_a_bad_batch_is_refused_whole_and_loses_nothing(store):
    (rollout, attempt), (other, other_attempt) = _claimed(store, 2)
    good = _conversation(rollout.rollout_id, attempt.attempt_id, turns=2, prompt_len=20)
    store.add_spans(good)

    def span(**kw) -> Span:
        return Span(**{"rollout_id": rollout.rollout_id, "attempt_id": attempt.attempt_id, "kind": "llm",
                       "sequence": 9, "prompt_token_ids": [1, 2], **kw})  # fmt: skip

    bad_batches = {
        NotFound: [
            [span(), span(attempt_id="at-missing")],
            [span(), span(rollout_id="ro-missing")],
            [span(), span(attempt_id=other_attempt.attempt_id)],  # attempt of another rollout
        ],
        Conflict: [[span(), span(span_id=good[0].span_id)], [span(span_id="sp-x"), span(span_id="sp-x")]],
        InvalidInput: [[span(), span(prompt_token_ids=[2**31])], [span(response_token_ids=[-(2**31) - 1])]],
        pydantic.ValidationError: [
            [span().model_dump(), {**span().model_dump(), "prompt_token_ids": ["a"]}],
            [{"rollout_id": rollout.rollout_id}],
            [{**span().model_dump(), "kind": "nonsense"}],
        ],
    }
    for error, batches in bad_batches.items():
        for batch in batches:
            with pytest.raises(error):
                store.add_spans(batch)
    assert store.list_spans() == good
    store.add_spans([span()])  # the store still accepts good input, and a dict is validated the same
    store.add_spans([span(sequence=10).model_dump()])
    assert store.count_spans(rollout_ids=[rollout.rollout_id]) == len(good) + 2
