"""Jobs: the whole graph for one snapshot, and the three pointer operations an authorized actor runs."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
from pydantic import Field

from lightning_dagster.orchestration.assets import snapshot_assets
from lightning_dagster.orchestration.assets.metadata import to_metadata
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import PipelineResource
from lightning_dagster.pipeline.stages import release

continual_learning = dg.define_asset_job(
    name="continual_learning",
    selection=dg.AssetSelection.assets(*snapshot_assets),
    partitions_def=snapshots,
    description="Every asset of one snapshot: plan, rollouts, training, evaluation, canary, rollback drill, receipt.",
    # One training per run; the `trainer` pool (dagster.yaml) keeps two runs from training at once.
    tags={"dagster/max_runtime": "3600"},
)


WHERE = "release_receipt's metadata (`run_config`) gives the run config to paste"


def _text(description: str, **kw: Any) -> Any:
    """A non-empty string field: an empty one is refused naming the field."""
    return Field(min_length=1, description=description, **kw)


class ApproveConfig(dg.Config):
    """A signed approval of one snapshot's receipt (a new receipt version): the fields
    `lightning-dagster registry sign RECEIPT --actor --role --key` prints."""

    snapshot_key: str = _text(
        "The snapshot partition whose receipt is approved (the receipt id without `rcpt-`); " + WHERE
    )
    actor: str = _text("The approver, an actor of the pinned roles (release_receipt: `actors`)")
    role: str = _text(
        "The role signed in; the default policy requires release-owner", default="release-owner"
    )
    step: str = _text("The step approved: canary or default", default="canary")
    at: float = Field(description="Signing time (Unix seconds), as `registry sign` prints it")
    evidence_hash: str = _text("The receipt's evidence hash the signature covers")
    signature: str = _text("The Ed25519 signature `registry sign` prints")

    def approval(self):
        """The approval these fields make; `InvalidInput` naming each bad field."""
        from pydantic import ValidationError

        from lightning_dagster.gate.errors import from_validation_error
        from lightning_dagster.gate.receipt import Approval

        try:
            return Approval.model_validate(self.model_dump(exclude={"snapshot_key"}))
        except ValidationError as err:
            raise from_validation_error("approval", err) from None


class PromoteConfig(dg.Config):
    """Move `approved-default` to the candidate of a passing, fresh receipt whose approvals verify and which
    holds `actor`'s signed default-step approval, by `actor`'s signed move: the fields `lightning-dagster
    registry sign-promote RECEIPT --actor --key` prints (signed against the pointer's state: moves once)."""

    receipt_id: str = _text(
        "The receipt to promote, `rcpt-<snapshot key>` (release_receipt: `receipt_id`); " + WHERE
    )
    actor: str = _text(
        "A default-approver of the pinned roles (release_receipt: `actors`) whose signed default-step "
        "approval the receipt holds"
    )
    role: str = _text("The role of that approval, as `sign-promote` prints it")
    seq: int = Field(
        description="The move this makes (the pointer's newest move + 1), as `sign-promote` prints it"
    )
    at: float = Field(description="Signing time (Unix seconds), as `sign-promote` prints it")
    signature: str = _text("The Ed25519 signature `sign-promote` prints")

    def request(self):
        """The signed promotion these fields make; `InvalidInput` naming each bad field."""
        from pydantic import ValidationError

        from lightning_dagster.gate.errors import from_validation_error
        from lightning_dagster.release.promotion import PromoteRequest

        try:
            return PromoteRequest.model_validate(self.model_dump())
        except ValidationError as err:
            raise from_validation_error("promotion", err) from None


class RollbackConfig(dg.Config):
    """An authorized actor's signed rollback of `approved-default` to an earlier version: the fields
    `lightning-dagster registry sign-rollback VERSION --actor --key --reason` prints (it rolls back once)."""

    target_version: str = _text(
        "An MLflow model version approved-default held before "
        "(release_receipt: `rollback_targets`; `lightning-dagster registry history`)"
    )
    from_version: str = _text("The version approved-default holds now, as `sign-rollback` prints it")
    from_seq: int = Field(description="The pointer's newest move, as `sign-rollback` prints it")
    actor: str = _text("A default-approver of the pinned roles (release_receipt: `actors`)")
    role: str = _text("The role signed in; only default-approver may", default="default-approver")
    reason: str = _text("Why approved-default goes back (signed)")
    at: float = Field(description="Signing time (Unix seconds), as `sign-rollback` prints it")
    signature: str = _text("The Ed25519 signature `sign-rollback` prints")

    def request(self):
        """The signed rollback these fields make; `InvalidInput` naming each bad field."""
        from lightning_dagster.release.rollbacks import rollback_request

        return rollback_request(self.model_dump())


@contextmanager
def refusals(action: str) -> Iterator[None]:
    """A refusal is an expected stop: a one-line `dg.Failure`, not a traceback."""
    from lightning_dagster.gate.errors import InvalidInput, TamperedReceipt
    from lightning_dagster.pipeline.context import ForeignReceipt, StageMissing
    from lightning_dagster.pipeline.loop_history import ResumeRefused, TamperedHistory
    from lightning_dagster.registry.errors import PointerConflict, RegistryError
    from lightning_dagster.store.errors import StoreUnavailable

    try:
        yield
    except (
        RegistryError,
        PointerConflict,
        InvalidInput,
        StageMissing,
        ForeignReceipt,
        TamperedReceipt,
        ResumeRefused,
        TamperedHistory,
        StoreUnavailable,
    ) as exc:
        reason = " ".join(str(exc).split())
        raise dg.Failure(
            description=reason if reason.startswith(f"{action} refused") else f"{action} refused: {reason}",
            metadata={"refused": type(exc).__name__, "reason": reason},
            allow_retries=False,
        ) from None


@dg.op(description="Record a signed approval on the snapshot's receipt once it verifies.")
def approve_receipt(config: ApproveConfig, pipeline: PipelineResource) -> dg.Output:
    with refusals("approval"):
        result = release.approve(pipeline, config.snapshot_key, config.approval())
    return dg.Output(None, metadata=to_metadata(result.metadata))


@dg.op(
    description="Promote by compare-and-set; refuses a HOLD or stale receipt, unverified approvals and an "
    "actor without a signed default-step approval."
)
def promote_candidate(config: PromoteConfig, pipeline: PipelineResource) -> dg.Output:
    with refusals("promotion"):
        result = release.promote(pipeline, config.request())
    return dg.Output(None, metadata=to_metadata(result.metadata))


@dg.op(
    description="Roll `approved-default` back to an exact earlier version once the actor's signed rollback "
    "verifies and the version's bytes do."
)
def rollback_default(config: RollbackConfig, pipeline: PipelineResource) -> dg.Output:
    with refusals("rollback"):
        result = release.rollback(pipeline, config.request())
    return dg.Output(None, metadata=to_metadata(result.metadata))


@dg.job(
    description="Record an authorized actor's signed approval of one snapshot's update step "
    "(run config: the fields `registry sign` prints, plus snapshot_key)."
)
def approve() -> None:
    approve_receipt()


@dg.job(
    description="Move approved-default to a passing, fresh receipt's candidate (run config: the fields "
    "`registry sign-promote` prints)."
)
def promote() -> None:
    promote_candidate()


@dg.job(
    description="Move approved-default back to an exact earlier version by an authorized actor's signed "
    "decision (run config: the fields `registry sign-rollback` prints)."
)
def rollback() -> None:
    rollback_default()


class ResumeConfig(dg.Config):
    """An authorized actor's signed resume of the paused loop, in a role the pause names: the fields
    `lightning-dagster loop sign --actor --role --key --reason` prints."""

    actor: str = _text("Who resumes: an actor of the pinned roles, as `loop sign` prints it")
    role: str = _text(
        "The role signed in: one the pause in force names (`lightning-dagster loop status`)",
        default="default-approver",
    )
    reason: str = _text("Why the loop may learn again (signed)")
    at: float = Field(description="Signing time (Unix seconds), as `loop sign` prints it")
    pause_hash: str = _text("The pause in force this resume lifts, as `loop sign` prints it")
    signature: str = _text("The Ed25519 signature `loop sign` prints")


@dg.op(description="Record a signed resume of the paused loop once it verifies; the history is the output.")
def resume_loop(config: ResumeConfig, pipeline: PipelineResource) -> dg.Output:
    from lightning_dagster.pipeline import loop_history
    from lightning_dagster.pipeline.context import approvers

    store = pipeline.get_store()
    with refusals("resume"):
        recorded = loop_history.resume(
            store, loop_history.resume_request(config.model_dump()), actors=approvers(pipeline)
        )
    return dg.Output(None, metadata=to_metadata(loop_history.decision_metadata(store, recorded)))


@dg.job(
    description="Resume the paused continual-learning loop by an authorized actor's signed decision "
    "(run config: the fields `lightning-dagster loop sign` prints)."
)
def resume() -> None:
    resume_loop()


class RestoreAliasConfig(dg.Config):
    last_verified: float | None = Field(
        default=None, description="When the alias was last seen to agree (narrows the incident's window)"
    )


@dg.op(
    description="Make MLflow's approved-default alias agree with the store again; an alias moved outside the "
    "registry is recorded as an incident (`lightning-dagster registry history`) and observed on release_receipt."
)
def restore_alias(
    context: dg.OpExecutionContext, config: RestoreAliasConfig, pipeline: PipelineResource
) -> None:
    from lightning_dagster.pipeline.context import registry

    rec = registry(pipeline).reconcile(last_verified=config.last_verified)
    if rec.incident is not None:
        context.log.warning(f"pointer incident {rec.incident.number}: {rec.incident.summary()}")
        context.log_event(
            dg.AssetObservation(
                asset_key=dg.AssetKey("release_receipt"),
                description=rec.incident.summary(),
                metadata=to_metadata({"pointer_incident": rec.incident.number, **rec.incident.to_dict()}),
            )
        )


@dg.job(
    description="Restore approved-default's MLflow alias from the store (requested by approved_alias_sensor)."
)
def restore_approved_alias() -> None:
    restore_alias()
