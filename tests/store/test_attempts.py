"""The attempt state machine, rollout status following attempts, retries and the claim queue."""

from __future__ import annotations

import threading

import pytest

from lightning_dagster.store import Conflict, InvalidInput, NotFound, Store
from lightning_dagster.types import (
    ALLOWED_TRANSITIONS,
    TERMINAL_ATTEMPT_STATES,
    AttemptState,
    IllegalTransition,
    RetryKind,
    Rollout,
    RolloutKind,
    RolloutStatus,
)
from tests.store.conftest import run_processes


def _attempt_in(store: Store, state: AttemptState):
    """A rollout whose latest attempt is in `state`, reached only by legal moves."""
    (rollout,) = store.enqueue_rollouts([Rollout(task_id=f"in-{state.value}")])
    _, attempt = store.claim_rollout("w", rollout_ids=[rollout.rollout_id])
    if state is AttemptState.queued:
        store.transition_attempt(attempt.attempt_id, AttemptState.failed)
        attempt = store.retry_rollout(rollout.rollout_id, RetryKind.sample)
    elif state is not AttemptState.running:
        attempt = store.transition_attempt(attempt.attempt_id, state, reason_code="setup")
    assert attempt.state is state
    return rollout.rollout_id, attempt.attempt_id


def test_every_edge_of_the_state_machine_is_enforced(store):
    expected_status = {
        AttemptState.queued: RolloutStatus.queued,
        AttemptState.running: RolloutStatus.running,
        AttemptState.succeeded: RolloutStatus.succeeded,
        AttemptState.failed: RolloutStatus.failed,
        AttemptState.timeout: RolloutStatus.failed,
        AttemptState.unresponsive: RolloutStatus.failed,
        AttemptState.cancelled: RolloutStatus.cancelled,
    }
    for current in AttemptState:
        for target in AttemptState:
            rollout_id, attempt_id = _attempt_in(store, current)
            before = (store.get_attempt(attempt_id), store.get_rollout(rollout_id))
            if target in ALLOWED_TRANSITIONS[current]:
                moved = store.transition_attempt(attempt_id, target, reason_code="r", reason_message="why")
                assert moved == store.get_attempt(attempt_id)
                assert (moved.state, moved.reason_code, moved.reason_message) == (target, "r", "why")
                assert (moved.ended_at is not None) == (target in TERMINAL_ATTEMPT_STATES)
                assert store.get_rollout(rollout_id).status is expected_status[target]
            else:
                with pytest.raises(IllegalTransition) as err:
                    store.transition_attempt(attempt_id, target, reason_code="nope")
                assert (err.value.current, err.value.target) == (current, target)
                assert (store.get_attempt(attempt_id), store.get_rollout(rollout_id)) == before


def test_start_attempt_moves_a_queued_retry_once(store):
    rollout_id, attempt_id = _attempt_in(store, AttemptState.queued)
    started = store.start_attempt(attempt_id, "w2")
    assert (started.state, started.worker_id, started.sequence_id) == (AttemptState.running, "w2", 2)
    assert started.retry_kind is RetryKind.sample and started.started_at is not None
    assert store.get_rollout(rollout_id).status is RolloutStatus.running
    with pytest.raises(IllegalTransition):
        store.start_attempt(attempt_id, "w3")  # a second starter loses
    assert store.get_attempt(attempt_id).worker_id == "w2"


def test_retries_keep_every_attempt_and_refuse_while_one_is_live(store):
    rollout_id, first = _attempt_in(store, AttemptState.running)
    with pytest.raises(Conflict):
        store.retry_rollout(rollout_id, RetryKind.infrastructure)
    with pytest.raises(InvalidInput):
        store.retry_rollout(rollout_id, RetryKind.first)
    store.transition_attempt(first, AttemptState.timeout, reason_code="timeout")
    retry = store.retry_rollout(rollout_id, RetryKind.infrastructure)
    assert store.get_rollout(rollout_id).status is RolloutStatus.queued
    rollout, claimed = store.claim_rollout("w9", rollout_ids=[rollout_id])
    assert claimed.attempt_id == retry.attempt_id and claimed.worker_id == "w9"
    assert rollout.status is RolloutStatus.running
    # A late move of the superseded attempt does not drive the rollout.
    store.transition_attempt(retry.attempt_id, AttemptState.succeeded, reason_code="ok")
    attempts = store.list_attempts(rollout_id=rollout_id)
    assert [(a.sequence_id, a.state, a.retry_kind) for a in attempts] == [
        (1, AttemptState.timeout, RetryKind.first),
        (2, AttemptState.succeeded, RetryKind.infrastructure),
    ]
    assert store.list_attempts(rollout_ids=[rollout_id], state="timeout")[0].attempt_id == first
    assert store.get_rollout(rollout_id).status is RolloutStatus.succeeded


def test_finish_heartbeat_and_unknown_ids(store):
    rollout_id, attempt_id = _attempt_in(store, AttemptState.running)
    before = store.get_attempt(attempt_id).heartbeat_at
    store.heartbeat(attempt_id)
    assert store.get_attempt(attempt_id).heartbeat_at >= before
    store.finish_rollout(rollout_id, RolloutStatus.cancelled)
    assert store.get_rollout(rollout_id).status is RolloutStatus.cancelled
    with pytest.raises(InvalidInput):
        store.finish_rollout(rollout_id, RolloutStatus.running)
    with pytest.raises(ValueError):
        store.finish_rollout(rollout_id, "bogus")
    for call in (
        lambda: store.get_attempt("at-missing"),
        lambda: store.heartbeat("at-missing"),
        lambda: store.transition_attempt("at-missing", AttemptState.failed),
        lambda: store.start_attempt("at-missing", "w"),
        lambda: store.retry_rollout("ro-missing", RetryKind.sample),
        lambda: store.finish_rollout("ro-missing", RolloutStatus.failed),
        lambda: store.get_rollout("ro-missing"),
    ):
        with pytest.raises(NotFound):
            call()
    assert store.get_rollout(rollout_id).status is RolloutStatus.cancelled


def test_claim_takes_the_oldest_matching_rollout(store):
    a, b, c = store.enqueue_rollouts(
        [
            Rollout(kind=RolloutKind.holdout, snapshot_key="s1", status=RolloutStatus.succeeded),
            Rollout(kind=RolloutKind.train, snapshot_key="s1"),
            Rollout(kind=RolloutKind.train, snapshot_key="s2"),
        ]
    )
    assert a.status is RolloutStatus.queued  # enqueue always queues
    assert store.claim_rollout("w", kinds=["canary"]) is None
    rollout, attempt = store.claim_rollout("w", snapshot_key="s2")
    assert rollout.rollout_id == c.rollout_id and attempt.sequence_id == 1
    assert store.claim_rollout("w", kinds=RolloutKind.train)[0].rollout_id == b.rollout_id
    assert store.claim_rollout("w")[0].rollout_id == a.rollout_id
    assert store.claim_rollout("w") is None
    assert [r.rollout_id for r in store.query_rollouts(snapshot_key="s1", status="running")] == [
        a.rollout_id,
        b.rollout_id,
    ]
    assert store.query_rollouts(kind=["holdout", "canary"], limit=5) == [store.get_rollout(a.rollout_id)]
    assert store.query_rollouts(created_after=c.created_at) == []
    with pytest.raises(ValueError):
        store.query_rollouts(kind="nonsense")


N_ROLLOUTS = 40


def test_threads_never_double_claim(store):
    rollouts = store.enqueue_rollouts([Rollout(task_id=str(i)) for i in range(N_ROLLOUTS)])
    claimed: list[str] = []
    barrier = threading.Barrier(6)

    def work(worker: str) -> None:
        barrier.wait()
        while got := store.claim_rollout(worker):
            claimed.append(got[0].rollout_id)

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(r.rollout_id for r in rollouts)
    assert len(store.list_attempts()) == N_ROLLOUTS


def _claim_all(url: str, worker: str, barrier) -> list[str]:
    store = Store(url)
    barrier.wait()
    claimed = []
    while got := store.claim_rollout(worker):
        claimed.append(got[0].rollout_id)
    store.close()
    return claimed


def test_processes_never_double_claim(store, store_url):
    rollouts = store.enqueue_rollouts([Rollout(task_id=str(i)) for i in range(N_ROLLOUTS)])
    store.close()
    results = run_processes(_claim_all, [(store_url, f"p{i}") for i in range(4)])
    claimed = [rid for r in results for rid in r]
    assert sorted(claimed) == sorted(r.rollout_id for r in rollouts)
    attempts = store.list_attempts()
    assert len(attempts) == N_ROLLOUTS and {a.state for a in attempts} == {AttemptState.running}
    assert {a.worker_id for a in attempts} <= {f"p{i}" for i in range(4)}


def test_enqueue_is_all_or_nothing(store):
    (kept,) = store.enqueue_rollouts(
        [Rollout(task_id="kept", task={"q": 1}, group_id="g", metadata={"m": 1})]
    )
    assert store.get_rollout(kept.rollout_id) == kept
    with pytest.raises(Conflict):
        store.enqueue_rollouts([Rollout(task_id="new"), kept])
    with pytest.raises(ValueError):  # pydantic's ValidationError
        store.enqueue_rollouts([Rollout(task_id="new"), {"kind": "nonsense"}])
    assert store.query_rollouts() == [kept]
