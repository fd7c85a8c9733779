"""MLflow lineage of every candidate and the two pointers: `latest-candidate` (moves at every update) and
`approved-default` (moves only by an authorized promotion of a passing receipt, compare-and-set in the
store, mirrored to MLflow), with signed approvals, signed rollback to the exact parent and the rollback
drill.

Core package: imports nothing from Dagster.
"""

from lightning_dagster.registry.core import DEFAULT_MODEL_NAME, Registry
from lightning_dagster.registry.drill import DrillResult
from lightning_dagster.registry.errors import (
    AliasDiverged,
    ApprovalRefused,
    CheckpointFilesMismatch,
    KeyFileError,
    NotAuthorized,
    PointerConflict,
    PointerNotSet,
    PromotionRefused,
    RegistryError,
    RegistryUnavailable,
    RolesConfigError,
    RollbackRefused,
    UnknownVersion,
    WeightsMismatch,
)
from lightning_dagster.registry.incidents import PointerIncident
from lightning_dagster.registry.lineage import CandidateVersion, SnapshotRef
from lightning_dagster.registry.pointers import APPROVED, LATEST, ReconcileResult, ResolvedVersion
from lightning_dagster.registry.promotion import DEFAULT_APPROVER, PromotionResult
from lightning_dagster.registry.rollbacks import RollbackRequest
from lightning_dagster.registry.tracking import ensure_tracking_store

__all__ = [
    "APPROVED",
    "AliasDiverged",
    "ApprovalRefused",
    "DEFAULT_APPROVER",
    "DEFAULT_MODEL_NAME",
    "LATEST",
    "CandidateVersion",
    "CheckpointFilesMismatch",
    "DrillResult",
    "KeyFileError",
    "NotAuthorized",
    "PointerConflict",
    "PointerIncident",
    "PointerNotSet",
    "PromotionRefused",
    "PromotionResult",
    "ReconcileResult",
    "Registry",
    "RegistryError",
    "RegistryUnavailable",
    "ResolvedVersion",
    "RolesConfigError",
    "RollbackRefused",
    "RollbackRequest",
    "SnapshotRef",
    "UnknownVersion",
    "WeightsMismatch",
    "ensure_tracking_store",
]
