"""The pieces every stage needs, built from the pipeline resource: effective settings, registry, policy,
the harness and its tasks, the per-snapshot stage documents, and the fingerprints staleness compares."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster import paths
from lightning_dagster.gate.ledger import RECEIPT_SNAPSHOTS

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lightning_dagster.gate.check_ids import Check
    from lightning_dagster.gate.ledger import LedgerEntry
    from lightning_dagster.gate.policy import Policy
    from lightning_dagster.gate.receipt import CandidateArtifact, ParentRef, Receipt
    from lightning_dagster.pipeline.run import Pipeline
    from lightning_dagster.project import Project, TaskSet
    from lightning_dagster.registry.core import Registry
    from lightning_dagster.release.signing import ActorKey
    from lightning_dagster.runner.harness_spec import HarnessSpec
    from lightning_dagster.settings import PipelineSettings
    from lightning_dagster.store import Store

log = logging.getLogger(__name__)

# Store document collections written by the pipeline (append-only, like receipts).
SNAPSHOTS = "snapshots"  # the frozen task sets of one snapshot
STAGES = "pipeline"  # what each stage produced for a snapshot: file URIs, checkpoints, scores
FINGERPRINT_INPUTS = "fingerprint_inputs"  # the stage document of the settings the plan's fingerprints hash


class StageMissing(LookupError):
    """A stage ran before the stage whose output it reads (materialize the upstream asset first)."""

    def __init__(self, key: str, stage: str):
        super().__init__(f"snapshot {key}: `{stage}` has not been materialized yet")
        self.key, self.stage = key, stage


class ForeignReceipt(ValueError):
    """The ledger holds a receipt under a snapshot's receipt id that the pipeline did not write."""

    def __init__(self, key: str, rid: str):
        super().__init__(
            f"snapshot {key}: the ledger's receipt {rid} was not written by the pipeline; "
            "no stage builds on a receipt brought in by hand"
        )


class CandidateRecorded(ValueError):
    """The snapshot's receipt already records its candidate (a receipt records one)."""

    def __init__(self, key: str, version: str | None):
        super().__init__(
            f"snapshot {key} already has its candidate (version {version}); a receipt records one candidate: "
            "cut a new snapshot to train another"
        )


class NotRegistered(LookupError):
    """A receipt names a model the registry has no version of (planned before versions were recorded)."""


def settings(p: Pipeline) -> PipelineSettings:
    """The settings the run's stages read (`project.sections.effective`), the project file read now."""
    from lightning_dagster.project.sections import effective
    from lightning_dagster.settings import CONCERNS, PipelineSettings

    project = pipeline_project(p)
    return PipelineSettings(**{name: effective(project, getattr(p, name)) for name in CONCERNS})


def registry(p: Pipeline) -> Registry:
    from lightning_dagster.registry.core import Registry

    return Registry(p.mlflow.resolved_uri(), p.get_store(), p.mlflow.model_name, gate=settings(p).gate)


def approvers(p: Pipeline) -> Mapping[str, ActorKey]:
    """The deployment's pinned approvers; none (every approval fails check 7) when no roles are pinned."""
    from lightning_dagster.release.errors import RolesConfigError
    from lightning_dagster.release.roles import registry_roles

    try:
        return registry_roles(registry(p)).actors
    except RolesConfigError:
        return {}


def policy(p: Pipeline) -> Policy:
    from lightning_dagster.gate.policy import load_policy

    return load_policy(settings(p).gate.policy_path or None)


def project_harness(project: Project) -> HarnessSpec:
    """The one place a project becomes a runnable harness."""
    from lightning_dagster.project.harness import harness_spec

    return harness_spec(project)


@dataclass(frozen=True)
class HarnessSource:
    """The harness a pipeline runs and the project dataset its tasks come from."""

    spec: HarnessSpec
    project: Project
    dataset: TaskSet

    @property
    def name(self) -> str:
        return self.spec.name


def project_source(path: Path | str) -> HarnessSource:
    """A project's harness and its tasks file, read now (so a changed file is seen)."""
    from lightning_dagster.project import load_project, load_tasks

    project = load_project(path)
    return HarnessSource(project_harness(project), project, load_tasks(project))


def project_file(p: Pipeline) -> Path | str:
    """The pipeline's project: `project.project`, else the built-in example `project.harness`."""
    from lightning_dagster.project.examples import example_file

    return p.project.project or example_file(p.project.harness)


def pipeline_project(p: Pipeline) -> Project:
    """The pipeline's project file, loaded now (`project_file`); its settings sections feed `settings`."""
    from lightning_dagster.project import load_project

    return load_project(project_file(p))


def harness_source(p: Pipeline) -> HarnessSource:
    """The pipeline's project with its harness and tasks (`project_file`)."""
    return project_source(project_file(p))


# The canary runs the pipeline's own project (`harness_source`), never another agent; without a `verify` hook:
UNVERIFIABLE = "the harness has no `verify` hook to re-read the canary's effects (add `harness.verify`)"


def receipt_id(key: str) -> str:
    """The one way from a snapshot key to its receipt id; the way back is `receipt_snapshot`."""
    return f"rcpt-{key}"


def candidate_id(key: str) -> str:
    return f"cand-{key}"


def snapshot_dir(key: str) -> Path:
    from lightning_dagster.pipeline.snapshots import validate_snapshot_key

    path = paths.home() / "snapshots" / validate_snapshot_key(key)
    path.mkdir(parents=True, exist_ok=True)
    return path


def candidate_dir(key: str) -> Path:
    from lightning_dagster.pipeline.snapshots import validate_snapshot_key

    return paths.models_dir() / "candidates" / validate_snapshot_key(key)


# ---------------------------------------------------------------- append-only stage documents


def save_doc(store: Store, collection: str, doc_id: str, body: dict) -> int:
    from lightning_dagster.gate.hashing import content_hash
    from lightning_dagster.store.documents import append_chained

    return append_chained(store, collection, doc_id, body, lambda _: content_hash(body), attempts=1)


def load_doc(store: Store, collection: str, doc_id: str) -> dict | None:
    versions = store.document_versions(collection, doc_id)
    return versions[-1].body if versions else None


def save_stage(store: Store, key: str, stage: str, body: dict) -> None:
    save_doc(store, STAGES, f"{key}/{stage}", body)


def load_stage(store: Store, key: str, stage: str) -> dict:
    body = load_doc(store, STAGES, f"{key}/{stage}")
    if body is None:
        raise StageMissing(key, stage)
    return body


def find_receipt(store: Store, key: str) -> Receipt | None:
    """The verified head of the snapshot's receipt (a broken chain raises `TamperedReceipt`), or None."""
    from lightning_dagster.gate import ReceiptLedger

    ledger, rid = ReceiptLedger(store), receipt_id(key)
    if not ledger.history(rid):
        return None
    if load_doc(store, RECEIPT_SNAPSHOTS, rid) is None:
        # `append_receipt` records the snapshot before the first version: a chain without it came from elsewhere
        raise ForeignReceipt(key, rid)
    return ledger.head(rid)


def never_ran(receipt: Receipt) -> set[Check]:
    """The checks of the stages that left no evidence (never ran, e.g. stopped by a blocking check)."""
    from lightning_dagster.gate.stage_table import STAGES, ran

    return {c for stage in STAGES if not ran(receipt, stage.name) for c in stage.blocking}


def head_receipt(store: Store, key: str) -> Receipt:
    receipt = find_receipt(store, key)
    if receipt is None:
        raise StageMissing(key, "update_plan")
    return receipt


def append_receipt(store: Store, key: str, receipt: Receipt) -> LedgerEntry:
    """A new version of the snapshot's receipt; the first also records which snapshot it belongs to."""
    from lightning_dagster.gate import ReceiptLedger

    if receipt.receipt_id != receipt_id(key):
        raise ValueError(f"receipt {receipt.receipt_id!r} is not the receipt of snapshot {key!r}")
    if load_doc(store, RECEIPT_SNAPSHOTS, receipt.receipt_id) is None:
        save_doc(store, RECEIPT_SNAPSHOTS, receipt.receipt_id, {"snapshot_key": key})
    entry = ReceiptLedger(store).append(receipt)
    if not entry.attested:
        log.warning(
            "receipt %s version %d written unattested: no pipeline key", entry.receipt_id, entry.version
        )
    return entry


def receipt_snapshot(store: Store, receipt_id: str) -> str | None:
    """The snapshot key a receipt was planned for, as recorded with its first version; None: unknown."""
    doc = load_doc(store, RECEIPT_SNAPSHOTS, receipt_id)
    return None if doc is None else str(doc["snapshot_key"])


def registered_version(ref: ParentRef | CandidateArtifact) -> str:
    """The registry version a receipt records for its parent or candidate."""
    if ref.model_version is None:
        raise NotRegistered(f"{ref.resource_id}: the receipt records no registry version")
    return ref.model_version


# ---------------------------------------------------------------- fingerprints for staleness


def fingerprint_inputs(p: Pipeline) -> dict[str, Any]:
    """The settings each setting-derived fingerprint hashes, kept so a change can be named."""
    from lightning_dagster.gate.hashing import fingerprint
    from lightning_dagster.pipeline.serving import retry_policy

    source, s = harness_source(p), settings(p)
    train = source.spec  # the canary's harness too
    closed = {"holdout": s.training.holdout_tasks, "protected": s.training.protected_tasks}
    return {
        # the held-out and protected cases drawn now: train tasks added later change neither
        "task_distribution": {
            split: fingerprint(source.dataset.draw(split, n, s.training.eval_seed))
            for split, n in closed.items()
        },
        "evaluator": {
            "name": s.gate.evaluator,
            "version": s.gate.evaluator_version,
            "harness": train.name,
            "holdout_tasks": s.training.holdout_tasks,
            "protected_tasks": s.training.protected_tasks,
            "eval_seed": s.training.eval_seed,
        },
        "tool_contract": {train.name: list(train.tools)},  # the tool schemas the harness offers its model
        "retry_policy": retry_policy(p, train).to_dict(),
        "permissions": sorted(canary_allowed_tools(p, train)),
        "destinations": sorted(canary_destinations(train)),
    }


def global_fingerprints(
    p: Pipeline, parent_weights_hash: str | None, inputs: Mapping[str, Any] | None = None
) -> dict[str, str | None]:
    """What the evidence of any receipt depends on right now, except the model it served."""
    from lightning_dagster.gate.hashing import fingerprint

    inputs = fingerprint_inputs(p) if inputs is None else inputs
    return {name: fingerprint(value) for name, value in inputs.items()} | {"parent": parent_weights_hash}


def changed_settings(p: Pipeline, key: str) -> dict[str, list[str]]:
    """Per fingerprint, the settings that differ between the snapshot's plan and now."""
    from lightning_dagster.gate.staleness import changed_settings as diff

    recorded = load_doc(p.get_store(), STAGES, f"{key}/{FINGERPRINT_INPUTS}")
    return {} if recorded is None else diff(recorded, fingerprint_inputs(p))


def canary_allowed_tools(p: Pipeline, canary: HarnessSpec) -> list[str]:
    names = [t["function"]["name"] for t in canary.tools if "function" in t]
    denied = settings(p).gate.canary_denied_tools
    return [n for n in names if n not in denied]


def canary_destinations(canary: HarnessSpec) -> list[str]:
    return [f"{canary.name}:destination"]


def current_fingerprints(p: Pipeline, key: str) -> dict[str, str | None]:
    """The fingerprints now, the served candidate's bytes included."""
    from lightning_dagster.engine import checkpoint_hash
    from lightning_dagster.registry.core import APPROVED
    from lightning_dagster.registry.errors import RegistryError

    try:  # read only: what the pointer names, never a repair of MLflow's mirror
        reg = registry(p)
        version = reg.current(APPROVED)
        parent_hash = reg.model_version(version).weights_hash if version else None
    except RegistryError:
        parent_hash = None  # unavailable: compared as "not given", so the receipt's own record stands
    current = global_fingerprints(p, parent_hash)
    try:
        checkpoint = Path(load_stage(p.get_store(), key, "candidate_resource")["checkpoint"])
        current["serving_model"] = checkpoint_hash(checkpoint) if checkpoint.is_dir() else "missing"
    except StageMissing:
        current["serving_model"] = None
    return current
