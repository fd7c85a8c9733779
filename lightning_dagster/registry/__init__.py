"""MLflow lineage of every candidate and the two pointers: `latest-candidate` and `approved-default`
(compare-and-set in the store, mirrored to MLflow), receipt tags on model versions and the rollback drill.
Core package: imports nothing from Dagster, nor from `lightning_dagster.release` (which builds on it).
"""

from lightning_dagster.registry.core import DEFAULT_MODEL_NAME, Registry
from lightning_dagster.registry.drill import DrillResult
from lightning_dagster.registry.errors import (
    AliasDiverged,
    CheckpointFilesMismatch,
    PointerConflict,
    PointerNotSet,
    RegistryError,
    RegistryUnavailable,
    UnknownVersion,
    WeightsMismatch,
)
from lightning_dagster.registry.incidents import PointerIncident
from lightning_dagster.registry.lineage import CandidateVersion, SnapshotRef
from lightning_dagster.registry.pointers import APPROVED, LATEST, ReconcileResult, ResolvedVersion
from lightning_dagster.registry.tracking import ensure_tracking_store

__all__ = [
    "APPROVED",
    "AliasDiverged",
    "DEFAULT_MODEL_NAME",
    "LATEST",
    "CandidateVersion",
    "CheckpointFilesMismatch",
    "DrillResult",
    "PointerConflict",
    "PointerIncident",
    "PointerNotSet",
    "ReconcileResult",
    "Registry",
    "RegistryError",
    "RegistryUnavailable",
    "ResolvedVersion",
    "SnapshotRef",
    "UnknownVersion",
    "WeightsMismatch",
    "ensure_tracking_store",
]
