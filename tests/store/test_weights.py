"""Policy versions and serving reports: publications count up in a hash chain, the fleet's version is the one
every live serving process serves, and claims skip rollouts tagged with any other version."""

from __future__ import annotations

import pytest

from lightning_dagster.store.errors import InvalidInput
from lightning_dagster.store.weights import ServingReport
from lightning_dagster.types import Rollout


def test_publications_count_up_and_chain(store):
    assert store.published_policy() is None
    first = store.publish_policy("res-1", "/w/1", "h1")
    second = store.publish_policy("res-2", "/w/2", "h2")
    assert (first.version, second.version) == (1, 2)
    assert store.published_policy() == second
    chain = store.document_versions("policy_versions", "fleet")
    assert chain[1].previous_hash == chain[0].content_hash
    with pytest.raises(InvalidInput, match="weights_hash"):
        store.publish_policy("res-3", "/w/3", "")


def test_the_fleet_version_is_the_one_every_live_process_serves(store):
    assert store.fleet_version() is None  # nobody serves: tagged rollouts wait
    store.report_serving(ServingReport(replica_id="a", version=1))
    store.report_serving(ServingReport(replica_id="b", version=1))
    assert store.fleet_version() == 1
    store.report_serving(ServingReport(replica_id="b", state="loading", version=1, target=2))
    assert store.fleet_version() is None  # b is switching
    store.report_serving(ServingReport(replica_id="b", version=2))
    assert store.fleet_version() is None  # a still serves 1
    store.report_serving(ServingReport(replica_id="a", state="stopped", version=1))
    assert store.fleet_version() == 2  # a stopped: only b counts
    assert [r.replica_id for r in store.serving_processes()] == ["b"]
    assert store.fleet_version(live_within_s=-1) is None  # reports older than the window are not live


def test_claims_skip_rollouts_tagged_with_another_version(store):
    tagged = [Rollout(task_id=f"v{v}", metadata={"policy_version": v}) for v in (2, 1)]
    plain = Rollout(task_id="plain")
    store.enqueue_rollouts([*tagged, plain])
    first = store.claim_rollout("w", policy_versions=())
    assert first[0].task_id == "plain"  # no version ready: only the untagged rollout
    assert store.claim_rollout("w", policy_versions=()) is None
    assert store.claim_rollout("w", policy_versions=[1])[0].task_id == "v1"
    assert store.claim_rollout("w")[0].task_id == "v2"  # no gate asked: any rollout
