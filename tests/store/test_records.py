"""Resources, rewards, serve rollouts, append-only documents, compare-and-set pointers and flags."""

from __future__ import annotations

import threading

import pydantic
import pytest
import sqlalchemy as sa

from lightning_dagster.store import (
    Conflict,
    InvalidInput,
    NotFound,
    PointerConflict,
    PointerSeqConflict,
    Store,
)
from lightning_dagster.types import AttemptState, Resource, Reward, Rollout, RolloutKind, RolloutStatus
from tests.store.conftest import run_processes


def test_resources(store):
    parent = store.add_resource(Resource(uri="/m/0", weights_hash="abc", metadata={"step": 0}))
    child = store.add_resource({"uri": "/m/1", "parent_id": parent.resource_id, "kind": "model"})
    assert store.get_resource(child.resource_id) == child
    assert store.list_resources() == [parent, child]
    with pytest.raises(Conflict):
        store.add_resource(parent)
    with pytest.raises(pydantic.ValidationError):
        store.add_resource({"uri": "/m/2", "kind": "weights"})
    with pytest.raises(NotFound):
        store.get_resource("res-missing")
    assert store.list_resources() == [parent, child]


def test_rewards(store):
    (a, b) = store.enqueue_rollouts([Rollout(), Rollout()])
    _, attempt = store.claim_rollout("w", rollout_ids=[a.rollout_id])
    first = Reward(rollout_id=a.rollout_id, attempt_id=attempt.attempt_id, value=1.0, uncertainty=0.1)
    later = Reward(rollout_id=b.rollout_id, value=-0.5, judge="human", judge_version="2")
    store.add_reward(first)
    store.add_reward(later.model_dump())
    for bad, error in [
        ({"rollout_id": "ro-missing", "value": 1.0}, NotFound),
        ({"rollout_id": b.rollout_id, "attempt_id": attempt.attempt_id, "value": 1.0}, NotFound),
        ({"rollout_id": a.rollout_id, "value": "high"}, pydantic.ValidationError),
    ]:
        with pytest.raises(error):
            store.add_reward(bad)
    assert store.list_rewards() == [first, later]
    assert store.list_rewards(rollout_ids=[b.rollout_id]) == [later]


def test_serve_rollouts_one_per_session_even_under_concurrency(store):
    results: list = []

    def call() -> None:
        results.append(store.get_or_create_serve_rollout("session-1", "res-1"))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.rollout_id for r, _ in results}) == 1 and len({a.attempt_id for _, a in results}) == 1
    rollout, attempt = results[0]
    assert rollout.kind is RolloutKind.serve and rollout.status is RolloutStatus.running
    assert attempt.state is AttemptState.running and rollout.resource_id == "res-1"
    assert store.get_or_create_serve_rollout("session-2", None)[0].rollout_id != rollout.rollout_id
    assert len(store.query_rollouts(kind="serve")) == 2
    with pytest.raises(InvalidInput):
        store.get_or_create_serve_rollout("", None)


def test_documents_are_a_hash_chain_and_append_only(store):
    assert store.append_document("receipts", "r1", "h1", {"phase": 1}, None) == 1
    assert store.append_document("receipts", "r1", "h2", {"phase": 2}, "h1") == 2
    assert store.append_document("receipts", "r2", "h1", {"other": True}, None) == 1
    for previous in (None, "h1", "nope"):  # only the head may be extended
        with pytest.raises(Conflict):
            store.append_document("receipts", "r1", "h3", {"phase": 3}, previous)
    with pytest.raises(Conflict):
        store.append_document("receipts", "new", "h1", {}, "h0")  # a first version has no predecessor
    with pytest.raises(InvalidInput):
        store.append_document("receipts", "r1", "h3", ["not", "a", "dict"], "h2")
    versions = store.document_versions("receipts", "r1")
    assert [(d.version, d.content_hash, d.previous_hash, d.body) for d in versions] == [
        (1, "h1", None, {"phase": 1}),
        (2, "h2", "h1", {"phase": 2}),
    ]
    assert store.document_versions("receipts", "missing") == []
    for statement in ("UPDATE documents SET body = '{}'", "DELETE FROM documents"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"), store.engine.begin() as c:
            c.execute(sa.text(statement))
    assert store.document_versions("receipts", "r1") == versions


def test_concurrent_appends_to_one_head_admit_exactly_one(store):
    store.append_document("receipts", "r", "h1", {}, None)
    outcomes: list = []

    def append(i: int) -> None:
        try:
            outcomes.append(store.append_document("receipts", "r", f"h2-{i}", {"i": i}, "h1"))
        except Conflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=append, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes, key=str) == [2] + ["conflict"] * 5
    assert len(store.document_versions("receipts", "r")) == 2


def test_pointer_compare_and_set_and_history(store):
    assert store.current_pointer("approved-default") is None
    first = store.move_pointer("approved-default", expected=None, to="v1", actor="alice", receipt_id="rc1")
    store.move_pointer("approved-default", expected="v1", to="v2", actor="bob", note="promote")
    with pytest.raises(PointerConflict) as err:
        store.move_pointer("approved-default", expected="v1", to="v3", actor="mallory")
    assert (err.value.expected, err.value.actual) == ("v1", "v2")
    with pytest.raises(PointerConflict):
        store.move_pointer("approved-default", expected=None, to="v3", actor="mallory")
    with pytest.raises(InvalidInput):
        store.move_pointer("approved-default", expected="v2", to="", actor="bob")
    assert store.current_pointer("approved-default") == "v2"
    assert store.current_pointer("latest-candidate") is None  # pointers never alias one another
    history = store.pointer_history("approved-default")
    assert history[0] == first
    assert [(m.seq, m.from_value, m.to_value, m.actor, m.receipt_id, m.note) for m in history] == [
        (1, None, "v1", "alice", "rc1", ""),
        (2, "v1", "v2", "bob", None, "promote"),
    ]
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), store.engine.begin() as c:
        c.execute(sa.text("DELETE FROM pointer_moves"))
    assert store.pointer_history("approved-default") == history


def test_pointer_move_compares_the_move_number_not_only_the_value(store):
    """A -> B -> A by another actor between a read and a move: the value is back, the decision is stale."""
    assert store.pointer_state("p") == (None, 0)
    store.move_pointer("p", expected=None, to="A", actor="setup", expected_seq=0)
    read = store.pointer_state("p")
    assert read == ("A", 1)
    store.move_pointer("p", expected="A", to="B", actor="other", expected_seq=1)
    store.move_pointer("p", expected="B", to="A", actor="other", expected_seq=2)
    with pytest.raises(PointerSeqConflict) as err:
        store.move_pointer("p", expected=read[0], to="C", actor="stale", expected_seq=read[1])
    assert (err.value.expected_seq, err.value.actual_seq) == (1, 3)
    assert (err.value.expected, err.value.actual) == ("A", "A")
    assert "expected move 1" in str(err.value) and "actual move 3" in str(err.value)
    assert isinstance(err.value, PointerConflict)  # one class for every compare-and-set loss
    assert store.pointer_state("p") == ("A", 3)
    # Without the move number the value alone still passes (the old contract, kept for callers that
    # hold no decision about an earlier state); with the current one it passes too.
    moved = store.move_pointer("p", expected="A", to="C", actor="fresh", expected_seq=3)
    assert (moved.seq, moved.from_value, moved.to_value) == (4, "A", "C")
    with pytest.raises(PointerSeqConflict):  # a first move that finds the pointer set
        store.move_pointer("p", expected=None, to="D", actor="late", expected_seq=0)
    with pytest.raises(InvalidInput, match="expected_seq"):
        store.move_pointer("p", expected="C", to="D", actor="x", expected_seq=-1)
    assert [m.seq for m in store.pointer_history("p")] == [1, 2, 3, 4]


def _race_pointer_seq(url: str, name: str, seq: int, to: str, barrier) -> tuple[str, str]:
    store = Store(url)
    value, _ = store.pointer_state(name)
    barrier.wait()
    try:
        store.move_pointer(name, expected=value, to=to, actor=to, expected_seq=seq)
        return to, "won"
    except PointerSeqConflict as exc:
        return to, f"lost:{exc.expected_seq}->{exc.actual_seq}"
    finally:
        store.close()


@pytest.mark.parametrize("seq", [0, 1], ids=["first-move", "later-move"])
def test_pointer_race_on_the_move_number_has_exactly_one_winner(store, store_url, seq):
    if seq:
        store.move_pointer("p", expected=None, to="v0", actor="setup")
    store.close()
    racers = [f"w{i}" for i in range(4)]
    results = dict(run_processes(_race_pointer_seq, [(store_url, "p", seq, to) for to in racers]))
    winners = [to for to, result in results.items() if result == "won"]
    assert len(winners) == 1
    assert sorted(results.values()) == [f"lost:{seq}->{seq + 1}"] * 3 + ["won"]
    assert store.pointer_state("p") == (winners[0], seq + 1)


def _race_pointer(url: str, name: str, expected: str | None, to: str, barrier) -> tuple[str, str]:
    store = Store(url)
    barrier.wait()
    try:
        store.move_pointer(name, expected=expected, to=to, actor=to)
        return to, "won"
    except PointerConflict as exc:
        return to, f"lost:{exc.actual}"
    finally:
        store.close()


@pytest.mark.parametrize("expected", [None, "v0"], ids=["first-move", "later-move"])
def test_pointer_race_between_processes_has_exactly_one_winner(store, store_url, expected):
    if expected is not None:
        store.move_pointer("p", expected=None, to=expected, actor="setup")
    store.close()
    racers = [f"w{i}" for i in range(4)]
    results = dict(run_processes(_race_pointer, [(store_url, "p", expected, to) for to in racers]))
    winners = [to for to, result in results.items() if result == "won"]
    assert len(winners) == 1
    assert sorted(results.values()) == ["lost:" + winners[0]] * 3 + ["won"]
    assert store.current_pointer("p") == winners[0]
    assert [m.to_value for m in store.pointer_history("p")] == [expected, winners[0]][expected is None :]


def test_flags(store):
    assert store.get_flag("sensor.pause") is None
    store.set_flag("sensor.pause", {"reason": "coverage"})
    store.set_flag("sensor.pause", {"reason": "retry debt", "n": 3})
    assert store.get_flag("sensor.pause") == {"reason": "retry debt", "n": 3}
    with pytest.raises(InvalidInput):
        store.set_flag("sensor.pause", "paused")
    assert store.get_flag("sensor.pause") == {"reason": "retry debt", "n": 3}


def test_count_rollouts_counts_what_query_rollouts_returns(store):
    made = store.enqueue_rollouts(
        [Rollout(kind=RolloutKind.train, harness=h) for h in ("calc", "calc", "web")]
    )
    ids = [r.rollout_id for r in made]
    store.claim_rollout("w", rollout_ids=ids[:1])
    for status in (None, RolloutStatus.queued, "running", [RolloutStatus.queued, RolloutStatus.running]):
        for scope in ({}, {"rollout_ids": ids[1:]}, {"harness": "calc"}, {"rollout_ids": []}):
            expected = len(store.query_rollouts(status=status, **scope))
            assert store.count_rollouts(status=status, **scope) == expected, (status, scope)
    assert store.count_rollouts(rollout_ids=ids, status="succeeded") == 0
    with pytest.raises(ValueError):
        store.count_rollouts(status="finished")
