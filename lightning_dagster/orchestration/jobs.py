"""Jobs: the whole graph for one snapshot, and the three pointer operations an authorized actor runs."""

from collections.abc import Iterator
from contextlib import contextmanager

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


class ApproveConfig(dg.Config):
    """A signed approval of one snapshot's receipt (a new receipt version; the receipt stays immutable).
    The approver makes it with `lightning-dagster registry sign RECEIPT --actor --role --key`, which prints
    these fields; the signature covers them and the receipt's evidence hash."""

    snapshot_key: str = Field(
        min_length=1,
        description="The snapshot partition whose receipt is approved (the receipt id without `rcpt-`); "
        + WHERE,
    )
    actor: str = Field(
        min_length=1, description="The approver, an actor of the pinned roles (release_receipt: `actors`)"
    )
    role: str = Field(
        min_length=1,
        default="release-owner",
        description="The role signed in; the default policy requires release-owner",
    )
    step: str = Field(min_length=1, default="canary", description="The step approved: canary or default")
    at: float = Field(description="Signing time (Unix seconds), as `registry sign` prints it")
    evidence_hash: str = Field(min_length=1, description="The receipt's evidence hash the signature covers")
    signature: str = Field(min_length=1, description="The Ed25519 signature `registry sign` prints")

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
    """Move `approved-default` to the candidate of a passing, fresh receipt whose approvals all verify and
    which holds `actor`'s signed default-step approval (`registry approve RECEIPT --role default-approver`),
    by `actor`'s signed move: the fields `lightning-dagster registry sign-promote RECEIPT --actor --key`
    prints (the signature covers the move it makes: pointer, move number, from, to, weights, receipt version,
    role, time; so it promotes once, from the pointer state it was signed against)."""

    receipt_id: str = Field(
        min_length=1,
        description="The receipt to promote, `rcpt-<snapshot key>` (release_receipt: `receipt_id`); " + WHERE,
    )
    actor: str = Field(
        min_length=1,
        description="A default-approver of the pinned roles (release_receipt: `actors`) whose signed "
        "default-step approval the receipt holds",
    )
    role: str = Field(min_length=1, description="The role of that approval, as `sign-promote` prints it")
    seq: int = Field(
        description="The move this makes (the pointer's newest move + 1), as `sign-promote` prints it"
    )
    at: float = Field(description="Signing time (Unix seconds), as `sign-promote` prints it")
    signature: str = Field(min_length=1, description="The Ed25519 signature `sign-promote` prints")

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
    """An authorized actor's signed rollback of `approved-default` to an exact earlier version from the
    pointer history: the fields `lightning-dagster registry sign-rollback VERSION --actor --key --reason`
    prints (the signature covers them, this pointer and its newest move, so it rolls back once)."""

    target_version: str = Field(
        min_length=1,
        description="An MLflow model version approved-default held before "
        "(release_receipt: `rollback_targets`; `lightning-dagster registry history`)",
    )
    from_version: str = Field(
        min_length=1, description="The version approved-default holds now, as `sign-rollback` prints it"
    )
    from_seq: int = Field(description="The pointer's newest move, as `sign-rollback` prints it")
    actor: str = Field(
        min_length=1, description="A default-approver of the pinned roles (release_receipt: `actors`)"
    )
    role: str = Field(
        min_length=1, default="default-approver", description="The role signed in; only default-approver may"
    )
    reason: str = Field(min_length=1, description="Why approved-default goes back (signed)")
    at: float = Field(description="Signing time (Unix seconds), as `sign-rollback` prints it")
    signature: str = Field(min_length=1, description="The Ed25519 signature `sign-rollback` prints")

    def request(self):
        """The signed rollback these fields make; `InvalidInput` naming each bad field."""
        from lightning_dagster.release.rollbacks import rollback_request

        return rollback_request(self.model_dump())


@contextmanager
def refusals(action: str) -> Iterator[None]:
    """A refusal is an expected stop: a one-line `dg.Failure` with its reason as metadata, not a traceback."""
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


# ---------------------------------------------------------------- resume the continual-learning loop


class ResumeConfig(dg.Config):
    """An authorized actor's signed resume of the paused continual-learning loop: the fields
    `lightning-dagster loop sign --actor --role --key --reason` prints (the signature covers them and the
    pause in force). The actor must hold one of the roles the pause in force names."""

    actor: str = Field(
        min_length=1, description="Who resumes: an actor of the pinned roles, as `loop sign` prints it"
    )
    role: str = Field(
        min_length=1,
        default="default-approver",
        description="The role signed in: one the pause in force names (`lightning-dagster loop status`)",
    )
    reason: str = Field(min_length=1, description="Why the loop may learn again (signed)")
    at: float = Field(description="Signing time (Unix seconds), as `loop sign` prints it")
    pause_hash: str = Field(
        min_length=1, description="The pause in force this resume lifts, as `loop sign` prints it"
    )
    signature: str = Field(min_length=1, description="The Ed25519 signature `loop sign` prints")


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


# ---------------------------------------------------------------- restore approved-default's MLflow alias


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
