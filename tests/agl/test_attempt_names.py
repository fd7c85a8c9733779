"""Attempts on the Agent Lightning surface are named as Agent Lightning names them, by their sequence within
their rollout ("0" first, "1" its retry): every route that returns or takes an attempt translates, and our
attempt ids are neither shown nor accepted there. A deleted rollout's id can be created again."""

from __future__ import annotations

from lightning_dagster.store import agl_rollouts as store_agl
from lightning_dagster.types import AttemptState, RetryKind
from tests.agl.test_conformance import CHAT

NOTE = {"event_type": "note", "data": {"k": "v"}}


def retried(agl, rid: str) -> list:
    """A rollout whose first attempt ran and failed and whose retry waits, queued (our runner's retry)."""
    agl.create({"input": 1, "rollout_id": rid})
    assert agl.api.post(f"/api/rollouts/{rid}/attempt/0/events", json=NOTE).status_code == 200
    (first,) = agl.store.list_attempts(rollout_id=rid)
    agl.store.transition_attempt(first.attempt_id, AttemptState.failed, reason_code="exit_nonzero")
    agl.store.retry_rollout(rid, RetryKind.infrastructure)
    return agl.store.list_attempts(rollout_id=rid)


def test_the_first_attempt_is_named_0_on_every_route_and_its_internal_id_is_never_shown(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    assert agl.api.get("/api/rollouts/r1").json()["attempts"] == []
    posted = agl.api.post("/api/rollouts/r1/attempt/0/events", json=NOTE).json()  # starts the first attempt
    (attempt,) = agl.store.list_attempts(rollout_id="r1")
    assert posted["attempt_id"] == "0" and attempt.sequence_id == 1
    assert agl.api.get("/api/rollouts/r1").json()["attempts"] == ["0"]
    assert [e["attempt_id"] for e in agl.api.get("/api/rollouts/r1/events").json()] == ["0"]
    assert agl.api.post(agl.proxy("r1"), json=CHAT).status_code == 200
    assert {s.attempt_id for s in agl.store.list_spans(rollout_id="r1")} == {attempt.attempt_id}
    shown = [agl.api.get("/api/rollouts/r1").text, agl.api.get("/api/rollouts/r1/events").text]
    assert all(attempt.attempt_id not in text for text in shown)


def test_a_retry_is_named_1_and_each_name_reaches_its_own_attempt(agl):
    first, second = retried(agl, "r1")
    assert (first.sequence_id, second.sequence_id) == (1, 2) and second.state is AttemptState.queued
    posted = agl.api.post("/api/rollouts/r1/attempt/1/events", json=NOTE)  # starts the waiting retry
    assert posted.status_code == 200 and posted.json()["attempt_id"] == "1"
    assert agl.store.get_attempt(second.attempt_id).state is AttemptState.running
    assert agl.api.get("/api/rollouts/r1").json()["attempts"] == ["0", "1"]
    events = agl.api.get("/api/rollouts/r1/events").json()  # the latest attempt's, as Agent Lightning reads
    assert [(e["event_type"], e["attempt_id"]) for e in events] == [("note", "1")]
    reward = {"event_type": "reward", "data": {"value": 0.5}}
    assert agl.api.post("/api/rollouts/r1/attempt/0/events", json=reward).status_code == 200
    (stored,) = agl.store.list_rewards(rollout_id="r1")
    assert stored.attempt_id == first.attempt_id  # "0" is the first attempt, not the current one
    assert agl.api.post(agl.proxy("r1").replace("/attempt/0/", "/attempt/1/"), json=CHAT).status_code == 200
    llm = agl.store.list_spans(rollout_id="r1", kind="llm")
    assert [s.attempt_id for s in llm] == [second.attempt_id]


def test_names_other_than_an_existing_sequence_and_our_own_ids_are_404(agl):
    first, _ = retried(agl, "r1")
    for name in ("2", "01", "-1", "x", first.attempt_id):
        got = agl.api.post(f"/api/rollouts/r1/attempt/{name}/events", json=NOTE)
        assert got.status_code == 404, (name, got.text)
        assert "sequence" in got.text or "has no attempt" in got.text
        proxied = agl.api.post(agl.proxy("r1").replace("/attempt/0/", f"/attempt/{name}/"), json=CHAT)
        assert proxied.status_code == 404, (name, proxied.text)


def test_a_deleted_rollouts_id_is_created_again_fresh_and_the_old_record_is_kept_as_lineage(agl):
    agl.create({"input": 1, "rollout_id": "r1"})
    agl.patch("r1", state="running")
    reward = {"event_type": "reward", "data": {"value": 1.0}}
    assert agl.api.post("/api/rollouts/r1/attempt/0/events", json=reward).status_code == 200
    (old,) = agl.store.list_attempts(rollout_id="r1")
    assert agl.api.delete("/api/rollouts/r1").status_code == 204

    again = agl.api.post("/api/rollouts", json=[{"input": 2, "rollout_id": "r1"}])
    assert again.status_code == 201, again.text
    fresh = again.json()[0]
    assert fresh["input"] == 2 and fresh["status"]["state"] == "queuing" and fresh["status"]["version"] == 1
    assert agl.api.get("/api/rollouts/r1").json() == {"rollout": fresh, "attempts": []}
    assert agl.api.get("/api/rollouts/r1/events").json() == []
    assert agl.store.list_attempts(rollout_id="r1") == [] and agl.store.list_rewards(rollout_id="r1") == []
    tomb = agl.store.get_attempt(old.attempt_id).rollout_id  # the old attempt, reward and record: kept
    assert tomb.startswith("r1~deleted~") and agl.store.get_rollout(tomb).harness == store_agl.DELETED
    assert [r.value for r in agl.store.list_rewards(rollout_id=tomb)] == [1.0]
    assert agl.api.post("/api/rollouts/r1/attempt/0/events", json=NOTE).json()["attempt_id"] == "0"
    (new,) = agl.store.list_attempts(rollout_id="r1")
    assert new.attempt_id != old.attempt_id and new.sequence_id == 1
    assert agl.api.delete("/api/rollouts/r1").status_code == 204  # and once more
    assert agl.api.post("/api/rollouts", json=[{"input": 3, "rollout_id": "r1"}]).json()[0]["input"] == 3
