"""The `Registry` facade: one registered model's lineage in MLflow and its two pointers. It holds the
connection and the MLflow plumbing; lineage, pointers, the drill and the cache live in their own modules,
and moving `approved-default` is `lightning_dagster.release`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException, RestException

from lightning_dagster import paths
from lightning_dagster.registry import incidents, links, pointers, receipt_tags
from lightning_dagster.registry.approved import approved_for_serving
from lightning_dagster.registry.checkpoints import cached_checkpoint
from lightning_dagster.registry.drill import DrillResult, rollback_drill
from lightning_dagster.registry.errors import PointerConflict, RegistryUnavailable, UnknownVersion
from lightning_dagster.registry.incidents import PointerIncident
from lightning_dagster.registry.lineage import CandidateVersion, SnapshotRef, Timing, register_version
from lightning_dagster.registry.pointers import APPROVED, LATEST, ReconcileResult, ResolvedVersion
from lightning_dagster.registry.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    ensure_tracking_store,
    is_http,
    probe,
)
from lightning_dagster.settings import gate_from_env
from lightning_dagster.store import Store

DEFAULT_MODEL_NAME = "lightning-dagster-policy"


class Registry:
    """MLflow lineage plus the store-backed `approved-default` pointer for one registered model."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        store: Any = None,
        model_name: str = DEFAULT_MODEL_NAME,
        artifact_root: Path | str | None = None,
        *,
        experiment_name: str = "lightning-dagster",
        cache_dir: Path | str | None = None,
        roles_file: Path | str | None = None,
        gate: Any = None,
    ) -> None:
        self.tracking_uri = tracking_uri or paths.mlflow_tracking_uri()
        self.store = Store() if store is None else store
        self.model_name = model_name
        self.experiment_name = experiment_name
        # A SQL tracking store needs an explicit artifact location; a server proxies its own.
        self.artifact_root = (
            None if is_http(self.tracking_uri) else Path(artifact_root or paths.mlflow_artifact_root())
        )
        self.cache_dir = Path(cache_dir) if cache_dir else paths.home() / "registry-cache"
        # The anchors every read verifies the pointer against (`release.chain`: roles file, roles-admin and
        # pipeline keys), by default from the code location's environment; `roles_file` overrides the file.
        gate = gate or gate_from_env()
        self.gate = gate.updated({"roles_path": str(roles_file)}) if roles_file else gate
        self.roles_file = self.gate.roles_path or None
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self.experiment_id: str | None = None  # set by `connect`
        self._model_ready = False

    def pointer_name(self, alias: str = APPROVED) -> str:
        """The store's pointer name: the bare alias for the default model, namespaced otherwise."""
        return alias if self.model_name == DEFAULT_MODEL_NAME else f"{self.model_name}/{alias}"

    def call_mlflow(self, what: str, fn, *args, **kwargs):
        """Call MLflow; connection failures become `RegistryUnavailable` (a clear, named error)."""
        try:
            return fn(*args, **kwargs)
        except RestException:
            raise
        except MlflowException as exc:
            if _is_connection_error(exc):
                raise RegistryUnavailable(self.tracking_uri, f"{what}: {exc}") from exc
            raise
        except OSError as exc:  # requests' ConnectionError is an OSError
            raise RegistryUnavailable(self.tracking_uri, f"{what}: {exc}") from exc

    def connect(self) -> None:
        """Reachability first (fast failure), then the store schema, experiment and registered model."""
        probe(self.tracking_uri)
        if self._model_ready:
            return
        ensure_tracking_store(self.tracking_uri)
        exp = self.call_mlflow("get experiment", self.client.get_experiment_by_name, self.experiment_name)
        if exp is None:
            location = self.artifact_root.resolve().as_uri() if self.artifact_root else None
            try:
                self.experiment_id = self.client.create_experiment(
                    self.experiment_name,
                    artifact_location=location,
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
                )
            except MlflowException as exc:  # another process created it first
                if not _already_exists(exc):
                    raise
                self.experiment_id = self.client.get_experiment_by_name(self.experiment_name).experiment_id
        else:
            self.experiment_id = exp.experiment_id
            if EXPERIMENT_KIND_TAG not in exp.tags:  # an experiment made before the kind was set
                self.call_mlflow(
                    "set experiment tag",
                    self.client.set_experiment_tag,
                    self.experiment_id,
                    EXPERIMENT_KIND_TAG,
                    EXPERIMENT_KIND,
                )
        try:
            self.call_mlflow("create registered model", self.client.create_registered_model, self.model_name)
        except MlflowException as exc:
            if not _already_exists(exc):
                raise
        self._model_ready = True

    def model_version(self, version: str) -> CandidateVersion:
        """A registered version's typed identities; `UnknownVersion` if the model has no such version."""
        try:
            mv = self.call_mlflow(
                "get model version", self.client.get_model_version, self.model_name, str(version)
            )
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise UnknownVersion(self.model_name, str(version)) from exc
            raise
        return CandidateVersion.of(mv, self.model_name)

    def alias_version(self, alias: str) -> Any:
        """MLflow's `ModelVersion` an alias points at (its tags carry the mirror's seq), or None if unset."""
        try:
            return self.call_mlflow(
                "get alias", self.client.get_model_version_by_alias, self.model_name, alias
            )
        except MlflowException as exc:  # RestException from a server, MlflowException from a SQL store
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def fetch(self, version: CandidateVersion, *, fresh: bool = False) -> Path:
        """The version's checkpoint in the local cache, verified; `fresh`: downloaded even if cached."""

        def download(run_id: str, into: Path) -> None:
            self.call_mlflow(
                "download artifacts", self.client.download_artifacts, run_id, "checkpoint", str(into)
            )

        return cached_checkpoint(version, self.cache_dir / self.model_name, download, fresh=fresh)

    def log_candidate(
        self,
        checkpoint_dir: Path | str,
        *,
        parent_version: str,
        snapshot_key: str,
        algorithm_config: Mapping[str, Any],
        metrics_per_step: Sequence[Mapping[str, float]],
        train_snapshot: SnapshotRef | Mapping[str, Any],
        heldout_snapshot: SnapshotRef | Mapping[str, Any],
        receipt: Any = None,
        receipt_id: str | None = None,
        code_revision: str = "",
        evaluator_version: str = "",
        orchestrator_run_id: str = "",
        started_at: float | None = None,
        ended_at: float | None = None,
    ) -> CandidateVersion:
        """Log a trained candidate of a registered parent and move `latest-candidate` to it; its tags name the
        ledger head of `receipt` (a `Receipt` or its JSON; verdict `pending` until `receipt_tags.write`)."""
        self.reconcile()
        if receipt is not None and hasattr(receipt, "to_json_dict"):
            receipt_id = receipt_id or receipt.receipt_id
            receipt = receipt.to_json_dict()
        receipt_id = receipt_id or (str(receipt.get("receipt_id", "")) if receipt else "")
        if (started_at is None) != (ended_at is None):
            raise ValueError("started_at and ended_at are given together or not at all")
        ledger_head = receipt_tags.head(self.store, receipt_id) if receipt_id else None
        parent = self.model_version(parent_version)
        tags = {
            "kind": "candidate",
            "parent_version": parent.version,
            "parent_weights_hash": parent.weights_hash,
            "snapshot_key": snapshot_key,
            "receipt_id": receipt_id,
            # empty values are left out (`register_version`)
            "receipt_version": str(ledger_head[0]) if ledger_head else "",
            "receipt_hash": ledger_head[1] if ledger_head else "",
            "verdict": receipt_tags.PENDING if receipt_id else "",
            "code_revision": code_revision,
            "evaluator_version": evaluator_version,
            "orchestrator_run_id": orchestrator_run_id,
        }
        candidate = register_version(
            self,
            Path(checkpoint_dir),
            run_name=f"candidate-{snapshot_key}",
            tags=tags,
            params=algorithm_config,
            metrics_per_step=metrics_per_step,
            snapshots=[
                (SnapshotRef.of(train_snapshot), "training"),
                (SnapshotRef.of(heldout_snapshot), "evaluation"),
            ],
            receipt=receipt,
            timing=None if started_at is None else Timing(started_at, ended_at),
        )
        self.call_mlflow(
            "set alias", self.client.set_registered_model_alias, self.model_name, LATEST, candidate.version
        )
        return candidate

    def register_initial_parent(
        self,
        checkpoint_dir: Path | str,
        *,
        actor: str = "bootstrap",
        code_revision: str = "",
        note: str = "initial parent",
        key: Any = None,
    ) -> CandidateVersion:
        """Register the first parent as `approved-default`, once, by the pipeline's `key`."""
        from lightning_dagster.release import chain  # the signed move is the release's

        key = key or chain.pipeline_signer(self.gate)  # no key: refused before anything is registered
        self.reconcile()
        current, seq = self.store.pointer_state(self.pointer_name())
        if current is not None:
            raise PointerConflict(self.pointer_name(), None, current)
        version = register_version(
            self,
            Path(checkpoint_dir),
            run_name="initial-parent",
            tags={"kind": "initial-parent", "code_revision": code_revision},
            params={},
        )
        pointers.move(
            self,
            expected=None,
            expected_seq=seq,  # 0: a bootstrap racing another one (or any move) is refused, not repeated
            to=version.version,
            actor=actor,
            note=note,
            signed=chain.bootstrap_note(self, version, key, actor),
        )
        pointers.mirror_after_move(self)
        return version

    def verified(self) -> Any:
        """`approved-default`'s history verified (`release.chain.verified`); a break is recorded once."""
        from lightning_dagster.release.chain import verified

        return verified(self)

    def reconcile(self, *, last_verified: float | None = None, check_only: bool = False) -> ReconcileResult:
        return pointers.reconcile(self, last_verified=last_verified, check_only=check_only)

    def current(self, alias: str = APPROVED) -> str | None:
        return pointers.current(self, alias)

    def resolve(self, alias: str = APPROVED, *, download: bool = True) -> ResolvedVersion:
        return pointers.resolve(self, alias, download=download)

    def download(self, version: str) -> Path:
        self.connect()
        return self.fetch(self.model_version(version))

    def history(self) -> list:
        """`approved-default`'s moves as stored, verified or not (`verified()` says which)."""
        return self.store.pointer_history(self.pointer_name())

    def incidents(self) -> list[PointerIncident]:
        return incidents.incidents(self.store, self.pointer_name())

    def serve_approved(self, *, download: bool = True) -> ResolvedVersion:
        return approved_for_serving(self, download=download)

    def rollback_drill(self, parent_version: str, *, record: bool = True, serving=None) -> DrillResult:
        return rollback_drill(self, parent_version, record=record, serving=serving)

    def ui_links(self, run_id: str, version: str) -> dict[str, str]:
        """MLflow UI addresses of a lineage run and a model version; {} when no UI address is known."""
        base = links.ui_url(self.tracking_uri)
        if not base:
            return {}
        self.connect()
        return {
            "mlflow_run": links.run_url(base, str(self.experiment_id), run_id),
            "mlflow_model_version": links.model_version_url(base, self.model_name, version),
        }

    def show(self) -> dict[str, Any]:
        """Both pointers, the MLflow mirror's view, and the registered versions (newest first)."""
        rec = self.reconcile()
        rm = self.client.get_registered_model(self.model_name)
        versions = self.client.search_model_versions(f"name='{self.model_name}'", max_results=200)
        newest = sorted(versions, key=lambda v: int(v.version), reverse=True)
        tags = ("kind", "weights_hash", "parent_version", "snapshot_key", "receipt_id")
        chain = rec.chain
        return {
            "model": self.model_name,
            "tracking_uri": self.tracking_uri,
            APPROVED: rec.pointer,
            "chain": "verified" if chain.problem is None else f"BROKEN: {chain.problem}",
            "pointer_row": chain.row[0],
            "mlflow_alias_" + APPROVED.replace("-", "_"): _alias(rm, APPROVED),
            LATEST: _alias(rm, LATEST),
            "versions": [{"version": str(v.version), **{k: v.tags.get(k, "") for k in tags}} for v in newest],
        }


def _alias(registered_model: Any, alias: str) -> str | None:
    """MLflow returns alias targets as ints from some stores and strings from others."""
    version = registered_model.aliases.get(alias)
    return None if version is None else str(version)


def _already_exists(exc: MlflowException) -> bool:
    return "RESOURCE_ALREADY_EXISTS" in str(exc.error_code) or "already exists" in str(exc)


def _is_connection_error(exc: MlflowException) -> bool:
    text = str(exc)
    return any(
        s in text for s in ("Max retries exceeded", "Connection refused", "ConnectionError", "API request to")
    )
