"""The pipeline core without a Dagster run: typed snapshot manifests, the retry policy the fingerprint
names, and pointer operations that refuse receipts the store cannot place."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys

import pytest

from lightning_dagster.gate.hashing import content_hash, fingerprint
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.serving import retry_policy
from lightning_dagster.pipeline.snapshots import (
    SnapshotTampered,
    build_manifest,
    load_manifest,
    save_manifest,
    snapshot_key,
    snapshot_refs,
)
from lightning_dagster.pipeline.stages import release
from lightning_dagster.project.examples import example_harness, example_tasks
from lightning_dagster.release.errors import PromotionRefused
from lightning_dagster.release.promotion import PromoteRequest
from tests.dagster.conftest import pipeline_for, tiny_training


def _usable_sandbox() -> str:
    """bwrap where it runs (the test setup installs it), else none: the setting must reach the runner."""
    from lightning_dagster.runner.execute import SandboxUnavailable, check_sandbox

    try:
        check_sandbox("bwrap")
    except SandboxUnavailable:
        return "none"
    return "bwrap"


def test_manifest_round_trips_through_the_store_and_names_its_key(embedded_home):
    p = pipeline_for()
    manifest = build_manifest(p, train_seed=7, serve_rollout_ids=["ro-b", "ro-a"])
    key = snapshot_key(manifest.digest, dt.datetime(2026, 11, 30, 8, 0, tzinfo=dt.UTC))
    save_manifest(p, key, manifest)
    loaded = load_manifest(p, key)
    assert loaded == manifest and loaded.serve_rollout_ids == ["ro-a", "ro-b"]
    assert key == f"snap-20261130T0800Z-{manifest.digest[:8]}"
    assert manifest.content_hash == content_hash(manifest.body())
    refs = snapshot_refs(manifest)
    assert refs["holdout"].content_hash == content_hash(manifest.splits.holdout)
    assert refs["train"].n_tasks == len(manifest.splits.train)


def test_closed_sets_are_named_alike_across_snapshots_and_train_sets_are_not(embedded_home):
    p = pipeline_for()
    a, b = (snapshot_refs(build_manifest(p, train_seed=s)) for s in (1, 2))
    assert a["holdout"].snapshot_id == b["holdout"].snapshot_id
    assert a["train"].snapshot_id != b["train"].snapshot_id


def test_a_tampered_manifest_is_refused_on_load(embedded_home):
    p = pipeline_for()
    manifest = build_manifest(p, train_seed=11)
    key = "snap-tampered"
    save_manifest(p, key, manifest)
    body = manifest.model_dump()
    body["splits"]["holdout"][0]["task_id"] = "swapped"
    ctx.save_doc(p.get_store(), ctx.SNAPSHOTS, key, body)
    with pytest.raises(SnapshotTampered, match="no longer hashes"):
        load_manifest(p, key)
    ctx.save_doc(p.get_store(), ctx.SNAPSHOTS, key, {"content_hash": manifest.content_hash})
    with pytest.raises(SnapshotTampered, match="not a manifest"):
        load_manifest(p, key)


def test_retry_policy_fingerprint_is_the_policy_the_runner_uses(embedded_home):
    p = pipeline_for()
    calc = example_harness("calc")
    assert retry_policy(p, calc) == calc.retry_policy()  # no override: the harness's own budget
    twice = p.model_copy(update={"training": tiny_training(max_attempts=2)})
    assert retry_policy(twice, calc).max_attempts == 2
    prints = ctx.global_fingerprints(twice, None)["retry_policy"]
    assert prints == fingerprint(retry_policy(twice, calc).to_dict())
    assert prints != ctx.global_fingerprints(p, None)["retry_policy"]


def test_a_project_harness_brings_its_own_timeout_and_attempts(embedded_home):
    spec = dataclasses.replace(example_harness("calc"), timeout_s=7.0, max_attempts=3)
    policy = retry_policy(pipeline_for(), spec)
    assert (policy.timeout_s, policy.max_attempts) == (7.0, 3)
    overridden = retry_policy(
        pipeline_for().model_copy(update={"training": tiny_training(max_attempts=2)}), spec
    )
    assert (overridden.timeout_s, overridden.max_attempts) == (7.0, 2)


# A promotion's signed fields for runs refused before its signature is checked.
UNSIGNED = {"role": "default-approver", "seq": 2, "at": 1.0, "signature": "unsigned"}


def test_promote_refuses_a_receipt_no_snapshot_planned(embedded_home):
    with pytest.raises(PromotionRefused, match="rcpt-unknown"):
        release.promote(pipeline_for(), PromoteRequest(**UNSIGNED, receipt_id="rcpt-unknown", actor="bob"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_resource_settings_decide_how_the_pipeline_serves_and_runs(embedded_home, tmp_path):
    """Runner mode, upstream URL, gateway port and secret, and attempts, set on the resources, are what a
    stage's service runs with."""
    from lightning_dagster.engine import build_base_model
    from lightning_dagster.gateway.server import GatewayServer
    from lightning_dagster.harnesses.corpus import training_corpus
    from lightning_dagster.orchestration.resources import ServingResource
    from lightning_dagster.pipeline.serving import rollout_service
    from lightning_dagster.types import RolloutKind, Sampling, SpanKind
    from tests.support.stub_upstream import create_stub_app

    model_dir = build_base_model(tmp_path / "model", corpus=training_corpus(n_per_split=20), seed=0)
    tasks = example_tasks("calc").draw("train", 2, 0)
    # The calc example runs in-process; its agent module is also a standalone program, for subprocess mode.
    calc = dataclasses.replace(
        example_harness("calc"), argv=(sys.executable, "-m", "lightning_dagster.harnesses.calc.agent")
    )
    port = free_port()
    sandbox = _usable_sandbox()
    with GatewayServer(create_stub_app()) as upstream:
        p = pipeline_for().model_copy(
            update={
                "serving": ServingResource(
                    upstream_url=upstream.url,
                    max_batch=4,
                    engine_threads=1,
                    runner_mode="subprocess",
                    sandbox=sandbox,
                    port=port,
                    secret="s3cret",
                    parallel=2,
                ),
                "training": tiny_training(max_attempts=2),
            }
        )
        with rollout_service(
            p,
            model_dir,
            snapshot_key="snap-settings",
            harness=calc,
            resource_id="res-p",
            serves_parent=True,
        ) as parent:
            service = parent.service
            assert service.runner.mode == "subprocess" and service.runner.sandbox == sandbox
            assert service.retry_policy == retry_policy(p, calc)
            assert service.retry_policy.max_attempts == 2
            assert service.gateway.url.endswith(f":{port}") and service.gateway.secret == "s3cret"
            batch = parent.run(tasks, group=1, kind=RolloutKind.train, sampling=Sampling(), seed=1, tag="set")
        llm = [s for spans in batch.spans.values() for s in spans if s.kind == SpanKind.llm]
        assert len(batch.spans) == 2 and {s.attributes["backend"] for s in llm} == {"upstream"}
        assert {r.snapshot_key for r in batch.rollouts} == {"snap-settings"}
        # A stage that serves weights it trains cannot use an upstream with fixed weights: the embedded
        # engine serves them, in a child process, under the same runner settings.
        with rollout_service(
            p,
            model_dir,
            snapshot_key="snap-settings",
            harness=calc,
            resource_id="res-c",
            serves_parent=False,
        ) as candidate:
            assert (
                candidate.service.runner.mode == "subprocess" and candidate.service.runner.sandbox == sandbox
            )
            # the engine in a process of its own (`model.engine_process`, on by default), the gateway's child
            assert any(
                "lightning_dagster.engine.remote" in cmd for cmd in _children(candidate.service.gateway.pid)
            )
            batch = candidate.run(
                tasks[:1], group=1, kind=RolloutKind.train, sampling=Sampling(), seed=1, tag="c"
            )
        llm = [s for spans in batch.spans.values() for s in spans if s.kind == SpanKind.llm]
        assert llm and {s.attributes["backend"] for s in llm} == {"engine"}


def _children(pid: int) -> list[str]:
    """Command lines of `pid`'s child processes."""
    from pathlib import Path

    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


def test_runner_parallel_is_auto_unless_set(embedded_home):
    """0 (the default): twice the engine's batch for in-process attempts, the batch for subprocess ones;
    a number is taken as it is; a negative one is refused by name."""
    import pydantic

    from lightning_dagster.orchestration.resources import ServingResource

    def with_(parallel: int, mode: str):
        return ServingResource(max_batch=24, parallel=parallel, runner_mode=mode)

    assert with_(0, "inprocess").attempts_at_once() == 48
    assert with_(0, "subprocess").attempts_at_once() == 24
    assert with_(5, "inprocess").attempts_at_once() == 5
    with pytest.raises(pydantic.ValidationError, match="parallel"):
        with_(-1, "inprocess")
