"""The pieces every stage needs, built from the pipeline resource: store, registry, policy, harnesses,
the per-snapshot documents the stages hand to each other, and the fingerprints staleness compares."""

from __future__ import annotations

import importlib
from functools import cache
from pathlib import Path
from typing import Any

from lightning_dagster import config
from lightning_dagster.pipeline.versions import code_version

# Store document collections written by the pipeline (append-only, like receipts).
SNAPSHOTS = "snapshots"  # the frozen task sets of one snapshot
STAGES = "pipeline"  # what each stage produced for a snapshot: rollout ids, file URIs, model versions


class StageMissing(LookupError):
    """A stage ran before the stage whose output it reads (materialize the upstream asset first)."""

    def __init__(self, key: str, stage: str):
        super().__init__(f"snapshot {key}: `{stage}` has not been materialized yet")
        self.key = key
        self.stage = stage


def registry(p: Any):
    from lightning_dagster.registry.core import Registry

    return Registry(
        p.mlflow.resolved_uri(),
        p.get_store(),
        p.mlflow.model_name,
        roles_file=p.gate.roles_path or None,
    )


def policy(p: Any):
    from lightning_dagster.gate.policy import load_policy

    return load_policy(p.gate.policy_path or None)


def harness(name: str):
    from lightning_dagster.harnesses.registry import get_harness

    return get_harness(name)


def harness_tools(name: str) -> list[dict]:
    """The tool schemas a harness offers its model: the tool contract staleness watches."""
    return list(getattr(importlib.import_module(harness(name).module), "TOOLS", []))


def receipt_id(key: str) -> str:
    return f"rcpt-{key}"


def candidate_id(key: str) -> str:
    return f"cand-{key}"


def snapshot_dir(key: str) -> Path:
    path = config.home() / "snapshots" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def candidate_dir(key: str) -> Path:
    return config.models_dir() / "candidates" / key


# ---------------------------------------------------------------- append-only stage documents


def save_doc(store: Any, collection: str, doc_id: str, body: dict) -> int:
    from lightning_dagster.gate.hashing import content_hash

    versions = store.document_versions(collection, doc_id)
    previous = versions[-1].content_hash if versions else None
    return store.append_document(collection, doc_id, content_hash(body), body, previous)


def load_doc(store: Any, collection: str, doc_id: str) -> dict | None:
    versions = store.document_versions(collection, doc_id)
    return versions[-1].body if versions else None


def save_stage(store: Any, key: str, stage: str, body: dict) -> None:
    save_doc(store, STAGES, f"{key}/{stage}", body)


def load_stage(store: Any, key: str, stage: str) -> dict:
    body = load_doc(store, STAGES, f"{key}/{stage}")
    if body is None:
        raise StageMissing(key, stage)
    return body


def find_receipt(store: Any, key: str):
    """The verified head of the snapshot's receipt (a broken chain raises `TamperedReceipt`), or None."""
    from lightning_dagster.gate import ReceiptLedger

    ledger = ReceiptLedger(store)
    return ledger.head(receipt_id(key)) if ledger.history(receipt_id(key)) else None


def head_receipt(store: Any, key: str):
    receipt = find_receipt(store, key)
    if receipt is None:
        raise StageMissing(key, "update_plan")
    return receipt


def append_receipt(store: Any, receipt: Any):
    """A new receipt version (amendments may only add); returns the ledger entry (version, content_hash)."""
    from lightning_dagster.gate import ReceiptLedger

    return ReceiptLedger(store).append(receipt)


# ---------------------------------------------------------------- fingerprints for staleness


@cache
def _source_fingerprint(*packages: str) -> str:
    return code_version(*packages)


def global_fingerprints(p: Any, parent_weights_hash: str | None) -> dict[str, str | None]:
    """What the evidence of any receipt depends on right now, except the model it served (per receipt)."""
    from lightning_dagster.gate.hashing import fingerprint
    from lightning_dagster.runner import RetryPolicy

    train = p.model.harness
    canary = canary_harness(p)
    return {
        "evaluator": fingerprint(
            {
                "name": p.gate.evaluator,
                "version": p.gate.evaluator_version,
                "harness": train,
                "holdout_tasks": p.training.holdout_tasks,
                "protected_tasks": p.training.protected_tasks,
                "eval_seed": p.training.eval_seed,
            }
        ),
        "tool_contract": fingerprint({train: harness_tools(train), canary: harness_tools(canary)}),
        "task_distribution": global_fingerprints_pool(p),
        "parent": parent_weights_hash,
        "retry_policy": fingerprint(RetryPolicy(max_attempts=1, timeout_s=120.0).to_dict()),
        "permissions": fingerprint(sorted(canary_allowed_tools(p))),
        "destinations": fingerprint(sorted(canary_destinations(p))),
    }


def global_fingerprints_pool(p: Any) -> str:
    """The task distribution: the harness and the code of its task generators."""
    from lightning_dagster.gate.hashing import fingerprint

    return fingerprint({"generator": _source_fingerprint("harnesses"), "harness": p.model.harness})


def canary_harness(p: Any) -> str:
    """The canary runs a harness whose effect can be re-read at its destination; the training harness
    when it can (`verify`), else the gate's configured canary harness."""
    return p.model.harness if harness(p.model.harness).verify is not None else p.gate.canary_harness


def canary_allowed_tools(p: Any) -> list[str]:
    names = [t["function"]["name"] for t in harness_tools(canary_harness(p)) if "function" in t]
    return [n for n in names if n not in p.gate.canary_denied_tools]


def canary_destinations(p: Any) -> list[str]:
    return [f"{canary_harness(p)}:destination"]
