"""Regenerate the gate's reference fixture: receipts for candidates A, B, C and D, each attested by the
fixture's pipeline key as a ledger's first version, and the policy they are judged by (a copy of the
packaged default). All four improve held-out reward; only A promotes.

    .venv/bin/python examples/gate/make_fixtures.py [OUT_DIR]

Built only through the receipt's public builders, with fixed ids and times, so the output is
byte-for-byte reproducible (tests/gate check that).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.gate import receipt as R
from lightning_dagster.gate.attestation import attest, with_attestation
from lightning_dagster.gate.hashing import fingerprint
from lightning_dagster.gate.ledger import version_hash
from lightning_dagster.release.approvals import approval_fields, evidence_hash
from lightning_dagster.release.signing import APPROVAL, public_key_line, sign
from lightning_dagster.types import (
    Attempt,
    AttemptState,
    RetryKind,
    Rollout,
    RolloutKind,
    RolloutStatus,
)

T0 = 1_796_112_000.0  # 2026-12-01T08:00Z: fixed so the files do not change between runs
PARENT = "res-parent-7f3a"
SPANS_PER_ROLLOUT = {"llm": 3, "tool": 2, "reward": 1}
DESTINATIONS = ["file:/srv/canary/out", "db:canary.results"]
TOOLS = ["calculator", "write_file"]
CANARY_TASKS = [f"canary-{k:02d}" for k in range(20)]
# alice's signing key, derived from a public seed so that the files are reproducible: an example key that
# anyone can rebuild, never one to approve anything real with.
ALICE_KEY = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"lightning-dagster example alice").digest())
# The fixture's pipeline key, which attests the four receipts: a FIXTURE key from a public seed, so that anyone
# can rebuild (and forge with) it. A deployment's pipeline key is its own, in a 0600 file outside models/
# and MLflow's artifacts (`gate.pipeline_key_path`); its public half is `pipeline.pub` here.
PIPELINE_KEY = Ed25519PrivateKey.from_private_bytes(
    hashlib.sha256(b"lightning-dagster example pipeline").digest()
)
ATTESTED_AT = T0 + 7400


def roles_text() -> str:
    """The approvers the fixture's signatures verify against, in the roles-file format (`gate evaluate --roles`)."""
    key = public_key_line(ALICE_KEY)
    return f"actors:\n  alice:\n    roles: [release-owner, ml-lead]\n    key: {key}\n"


def signed(receipt: R.Receipt, *, actor: str, role: str, step: str, at: float) -> R.Approval:
    unsigned = R.Approval(actor=actor, role=role, step=step, at=at, evidence_hash=evidence_hash(receipt))
    signature = sign(ALICE_KEY, APPROVAL, approval_fields(receipt.receipt_id, unsigned))
    return unsigned.model_copy(update={"signature": signature})


@dataclass
class Spec:
    """What differs between the four candidates; everything else is shared."""

    name: str
    margin: float
    failed_rollouts: int = 0  # retries exhausted
    infra_retried_failures: int = 0  # of those, how many had an infrastructure retry
    no_reward_span: int = 0  # finished but the reward span is missing
    sample_retries: int = 10
    infra_retries_ok: int = 2  # infrastructure retries that then succeeded
    protected_regressions: int = 0
    canary_unverified: int = 0
    parent_resolves: bool = True


SPECS = [
    Spec("a", margin=0.04),
    Spec(
        "b",
        margin=0.08,
        failed_rollouts=25,
        infra_retried_failures=18,
        no_reward_span=12,
        sample_retries=12,
        infra_retries_ok=0,
    ),
    Spec("c", margin=0.10, protected_regressions=3),
    Spec("d", margin=0.07, canary_unverified=2, parent_resolves=False),
]


def plan(spec: Spec) -> R.Plan:
    return R.Plan(
        candidate_id=f"res-cand-{spec.name}",
        parent=R.ParentRef(
            resource_id=PARENT,
            uri=f"models:/agent-policy/{PARENT}"
            if spec.parent_resolves
            else "models:/agent-policy/deleted-7f3a",
            weights_hash="sha256:" + "7f3a" * 16,
            resolves=spec.parent_resolves,
            loads=True if spec.parent_resolves else None,  # a parent that does not resolve was never loaded
        ),
        train_snapshot=R.SnapshotRef(
            snapshot_id="snap-20261130T0800Z-1a2b3c4d", content_hash="sha256:" + "1a2b" * 16, n_tasks=15
        ),
        holdout_snapshot=R.SnapshotRef(
            snapshot_id="holdout-v3",
            content_hash="sha256:" + "5e6f" * 16,
            n_tasks=120,
            families={"arithmetic": 60, "units": 60},
        ),
        protected_snapshot=R.SnapshotRef(
            snapshot_id="protected-v2",
            content_hash="sha256:" + "9c0d" * 16,
            n_tasks=30,
            families={"arith-core": 20, "format": 10},
        ),
        canary_snapshot=R.SnapshotRef(
            snapshot_id="canary-v1", content_hash="sha256:" + "3e4f" * 16, n_tasks=20, task_ids=CANARY_TASKS
        ),
        evaluator=R.EvaluatorRef(name="exact-answer", version="1.4.0"),
        algorithm={"name": "grpo", "group_size": 8, "lr": 1e-4, "clip": 0.2, "seed": 0},
        code_revision="b18ed42",
        scope="calculator agent, arithmetic and unit-conversion tasks",
        approvers=R.ApproverRoles(canary=["release-owner", "ml-lead"], default=["release-owner"]),
        expected_span_families={
            RolloutKind.train: ["llm", "tool", "reward"],
            RolloutKind.holdout: ["llm", "reward"],
            RolloutKind.canary: ["llm", "tool", "reward"],
        },
        expected_rollouts={RolloutKind.train: 120},
        retry_budget=R.RetryBudget(expected_sample_retries=12, infrastructure_retries=4),
        created_at=T0,
    )


def rollouts(spec: Spec) -> tuple[list[Rollout], list[Attempt], list[tuple[str, str]]]:
    """120 train rollouts: the first `failed_rollouts` fail, then sample-retried, infra-retried, rollouts
    lacking their reward span, and the rest plain successes."""
    rs, ats, spans = [], [], []
    n_sample_end = spec.failed_rollouts + spec.sample_retries
    n_infra_end = n_sample_end + spec.infra_retries_ok
    for i in range(120):
        rid = f"ro-{spec.name}-{i:03d}"
        failed = i < spec.failed_rollouts
        status = RolloutStatus.failed if failed else RolloutStatus.succeeded
        rs.append(
            Rollout(
                rollout_id=rid, kind=RolloutKind.train, task_id=f"t{i % 15}", status=status, created_at=T0
            )
        )

        def attempt(seq: int, state: AttemptState, kind: RetryKind, reason: str, rid: str = rid) -> None:
            ats.append(
                Attempt(
                    attempt_id=f"at-{rid[3:]}-{seq}",
                    rollout_id=rid,
                    sequence_id=seq,
                    state=state,
                    retry_kind=kind,
                    reason_code=reason,
                )
            )

        if failed and i < spec.infra_retried_failures:
            attempt(1, AttemptState.unresponsive, RetryKind.first, "no_heartbeat")
            attempt(2, AttemptState.failed, RetryKind.infrastructure, "exit_nonzero")
        elif failed:
            attempt(1, AttemptState.failed, RetryKind.first, "exit_nonzero")
        elif i < n_sample_end:
            attempt(1, AttemptState.failed, RetryKind.first, "malformed_tool_call")
            attempt(2, AttemptState.succeeded, RetryKind.sample, "ok")
        elif i < n_infra_end:
            attempt(1, AttemptState.timeout, RetryKind.first, "timeout")
            attempt(2, AttemptState.succeeded, RetryKind.infrastructure, "ok")
        else:
            attempt(1, AttemptState.succeeded, RetryKind.first, "ok")
        lacks_reward = n_infra_end <= i < n_infra_end + spec.no_reward_span
        for family, count in SPANS_PER_ROLLOUT.items():
            if failed and family == "reward" or lacks_reward and family == "reward":
                continue
            spans += [(rid, family)] * (count if not failed else 1)
    return rs, ats, spans


def build(spec: Spec) -> R.Receipt:
    p = plan(spec)
    cand = p.candidate_id
    receipt = R.from_plan(
        p,
        fingerprints=R.Fingerprints(
            evaluator=fingerprint({"name": "exact-answer", "version": "1.4.0"}),
            tool_contract=fingerprint({"tools": ["calculator", "write_file"], "version": 2}),
            task_distribution=fingerprint(
                {"train": p.train_snapshot.content_hash, "holdout": p.holdout_snapshot.content_hash}
            ),
            parent=fingerprint({"resource_id": PARENT, "weights_hash": p.parent.weights_hash}),
            serving_model=fingerprint({"resource_id": cand}),
            retry_policy=fingerprint({"max_attempts": 2, "sample_retry_on": ["malformed_tool_call"]}),
            # what the canary's limits may allow, sorted as the gate compares them
            permissions=fingerprint(sorted(TOOLS)),
            destinations=fingerprint(sorted(DESTINATIONS)),
        ),
    )
    rs, ats, spans = rollouts(spec)
    receipt = R.add_rollout_evidence(receipt, rs, ats, spans)
    receipt = R.add_candidate(
        receipt,
        R.CandidateArtifact(
            resource_id=cand,
            uri=f"models:/agent-policy/{cand}",
            weights_hash="sha256:" + spec.name * 64,
            parent_id=PARENT,
            model_version="8",
        ),
        at=T0 + 1800,
    )
    parent_mean = {"arithmetic": 0.52, "units": 0.56}
    holdout = R.HoldoutComparison(
        snapshot_id=p.holdout_snapshot.snapshot_id,
        parent_id=PARENT,
        candidate_id=cand,
        evaluator=p.evaluator,
        seed=1234,
        families=[
            R.FamilyScore(
                family=fam,
                n=60,
                distinct_tasks=60,
                candidate_mean=round(mean + spec.margin, 4),
                parent_mean=mean,
            )
            for fam, mean in parent_mean.items()
        ],
    )
    protected = R.ProtectedResults(
        snapshot_id=p.protected_snapshot.snapshot_id,
        parent_id=PARENT,
        candidate_id=cand,
        families=[
            R.ProtectedFamily(
                family="arith-core",
                n=20,
                regressed=[f"prot-arith-{k:02d}" for k in range(spec.protected_regressions)],
                missing=0,
            ),
            R.ProtectedFamily(family="format", n=10, regressed=[], missing=0),
        ],
    )
    receipt = R.add_evaluation(receipt, holdout, protected, at=T0 + 3600)
    tasks = []
    for k in range(20):
        dest = DESTINATIONS[k % 2]
        verified = k >= spec.canary_unverified
        tasks.append(
            R.CanaryTask(
                task_id=CANARY_TASKS[k],
                destination=dest,
                verified=verified,
                evidence="destination re-read, contents match"
                if verified
                else "harness exited 0; destination not re-read",
                uncertainty=None if verified else 0.3,
                harmful_effect=False,
            )
        )
    receipt = R.add_canary(
        receipt,
        R.CanaryReport(
            serving_resource_id=cand,
            limits=R.CanaryLimits(
                max_tasks=20,
                max_seconds=900,
                allowed_tools=TOOLS,
                max_cost=2.0,
                allowed_side_effects=DESTINATIONS,
            ),
            usage=R.CanaryUsage(
                tasks=20,
                seconds=412.0,
                tools_used=TOOLS,
                cost=0.84,
                side_effects=DESTINATIONS,
            ),
            tasks=tasks,
        ),
        at=T0 + 5400,
    )
    ok = spec.parent_resolves
    receipt = R.add_rollback_drill(
        receipt,
        R.RollbackDrill(
            parent_id=PARENT,
            environment="canary-gateway",
            resolved=ok,
            loaded=True if ok else None,
            routed_back=True if ok else None,
            at=T0 + 7200,
        ),
    )
    return R.add_approval(
        receipt, signed(receipt, actor="alice", role="release-owner", step="canary", at=T0 + 7300)
    )


def write(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in SPECS:
        path = out_dir / f"candidate-{spec.name}.json"
        path.write_text(json.dumps(attested(build(spec)), indent=1, sort_keys=True) + "\n")
        written.append(path)
    policy = out_dir / "policy.yaml"
    policy.write_text(
        resources.files("lightning_dagster.gate").joinpath("policies/default-v1.yaml").read_text()
    )
    roles = out_dir / "roles.yaml"
    roles.write_text(roles_text())
    pub = out_dir / "pipeline.pub"
    pub.write_text(public_key_line(PIPELINE_KEY) + "\n")
    return [*written, policy, roles, pub]


def attested(receipt: R.Receipt, key: Ed25519PrivateKey = PIPELINE_KEY) -> dict:
    """The receipt as a file: its body with `key`'s attestation of it as a ledger's first version."""
    body = receipt.to_json_dict()
    digest = version_hash(body, None)
    return with_attestation(body, attest(key, receipt.receipt_id, 1, digest, None, at=ATTESTED_AT))


if __name__ == "__main__":
    for path in write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent):
        print(path)
