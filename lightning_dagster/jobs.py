"""Jobs: the whole graph for one snapshot, and the three pointer operations an authorized actor runs."""

import dagster as dg

from lightning_dagster.assets import snapshot_assets
from lightning_dagster.assets.metadata import to_metadata
from lightning_dagster.partitions import snapshots
from lightning_dagster.pipeline.stages import release
from lightning_dagster.resources import PipelineResource

continual_learning = dg.define_asset_job(
    name="continual_learning",
    selection=dg.AssetSelection.assets(*snapshot_assets),
    partitions_def=snapshots,
    description="Every asset of one snapshot: plan, rollouts, training, evaluation, canary, rollback drill, receipt.",
    # One training per run; the `trainer` pool (dagster.yaml) keeps two runs from training at once.
    tags={"dagster/max_runtime": "3600"},
)


class ApproveConfig(dg.Config):
    """A signed approval of one snapshot's receipt (a new receipt version; the receipt stays immutable).
    The approver makes it with `lightning-dagster registry sign RECEIPT --actor --role --key`, which prints
    these fields; the signature covers them and the receipt's evidence hash."""

    snapshot_key: str
    actor: str
    role: str = "release-owner"  # the canary approver role the default policy requires
    step: str = "canary"
    at: float
    evidence_hash: str
    signature: str

    def approval(self):
        from lightning_dagster.gate.receipt import Approval

        return Approval.model_validate(self.model_dump(exclude={"snapshot_key"}))


class PromoteConfig(dg.Config):
    """Move `approved-default` to the candidate of a passing, fresh receipt whose approvals all verify and
    which holds `actor`'s signed default-step approval (`registry approve RECEIPT --role default-approver`)."""

    receipt_id: str
    actor: str


class RollbackConfig(dg.Config):
    """Move `approved-default` back to an exact earlier version from the pointer history."""

    target_version: str
    actor: str


@dg.op(description="Record a signed approval on the snapshot's receipt once it verifies.")
def approve_receipt(config: ApproveConfig, pipeline: PipelineResource) -> dg.Output:
    return dg.Output(
        None,
        metadata=to_metadata(release.approve(pipeline, config.snapshot_key, config.approval()).metadata),
    )


@dg.op(
    description="Promote by compare-and-set; refuses a HOLD or stale receipt, unverified approvals and an "
    "actor without a signed default-step approval."
)
def promote_candidate(config: PromoteConfig, pipeline: PipelineResource) -> dg.Output:
    return dg.Output(
        None, metadata=to_metadata(release.promote(pipeline, config.receipt_id, config.actor).metadata)
    )


@dg.op(description="Roll `approved-default` back to an exact earlier version after verifying its bytes.")
def rollback_default(config: RollbackConfig, pipeline: PipelineResource) -> dg.Output:
    return dg.Output(
        None, metadata=to_metadata(release.rollback(pipeline, config.target_version, config.actor).metadata)
    )


@dg.job(
    description="Record an authorized actor's signed approval of one snapshot's update step "
    "(run config: the fields `registry sign` prints, plus snapshot_key)."
)
def approve() -> None:
    approve_receipt()


@dg.job(
    description="Move approved-default to a passing, fresh receipt's candidate (run config: receipt_id, actor)."
)
def promote() -> None:
    promote_candidate()


@dg.job(
    description="Move approved-default back to an exact earlier version (run config: target_version, actor)."
)
def rollback() -> None:
    rollback_default()


# ---------------------------------------------------------------- resume the continual-learning loop


class ResumeConfig(dg.Config):
    """An authorized actor's signed resume of the paused continual-learning loop: the fields
    `lightning-dagster loop sign --actor --role --key --reason` prints (the signature covers them and the
    pause in force). The actor must hold one of the deployment's default-approver roles."""

    actor: str
    role: str = "default-approver"
    reason: str
    at: float
    pause_hash: str
    signature: str


@dg.op(description="Record a signed resume of the paused loop once it verifies; the history is the output.")
def resume_loop(config: ResumeConfig, pipeline: PipelineResource) -> dg.Output:
    from lightning_dagster.gate.pauses import ResumeRequest
    from lightning_dagster.pipeline import pauses
    from lightning_dagster.pipeline.context import approvers

    store = pipeline.get_store()
    recorded = pauses.resume(
        store,
        ResumeRequest.model_validate(config.model_dump()),
        actors=approvers(pipeline),
        allowed_roles=pipeline.gate.default_approver_roles,
    )
    return dg.Output(None, metadata=to_metadata(pauses.decision_metadata(store, recorded)))


@dg.job(
    description="Resume the paused continual-learning loop by an authorized actor's signed decision "
    "(run config: the fields `lightning-dagster loop sign` prints)."
)
def resume() -> None:
    resume_loop()
