"""MLflow lineage of every candidate and the two pointers: `latest-candidate` and `approved-default`
(compare-and-set in the store, mirrored to MLflow), receipt tags on model versions and the rollback drill.
Core package: imports nothing from Dagster, nor from `lightning_dagster.release` (which builds on it).
"""

from lightning_dagster.registry.core import Registry as Registry
from lightning_dagster.registry.drill import DrillResult as DrillResult
from lightning_dagster.registry.errors import AliasDiverged as AliasDiverged
from lightning_dagster.registry.errors import CheckpointFilesMismatch as CheckpointFilesMismatch
from lightning_dagster.registry.errors import PointerConflict as PointerConflict
from lightning_dagster.registry.errors import PointerNotSet as PointerNotSet
from lightning_dagster.registry.errors import RegistryUnavailable as RegistryUnavailable
from lightning_dagster.registry.errors import WeightsMismatch as WeightsMismatch
from lightning_dagster.registry.incidents import PointerIncident as PointerIncident
from lightning_dagster.registry.pointers import APPROVED as APPROVED
from lightning_dagster.registry.pointers import LATEST as LATEST
from lightning_dagster.registry.tracking import ensure_tracking_store as ensure_tracking_store
