"""The registry: candidate lineage in MLflow, and two pointers that never alias.

`latest-candidate` is an MLflow alias moved at every new candidate. `approved-default` lives in the store
(compare-and-set in one transaction, append-only history) and is mirrored to MLflow as an alias plus tags;
MLflow aliases have neither history nor compare-and-set, so MLflow is never the source of truth for it.
`reconcile()` makes the mirror agree with the store and runs at the start of every operation, so a mirror
write lost to an MLflow outage is repaired by the next operation once the server is back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException, RestException

from lightning_dagster import config
from lightning_dagster.registry import receipts
from lightning_dagster.registry.errors import (
    NotAuthorized,
    PointerConflict,
    PointerNotSet,
    PromotionRefused,
    RegistryError,
    RegistryUnavailable,
    UnknownVersion,
    WeightsMismatch,
)
from lightning_dagster.registry.lineage import CandidateVersion, SnapshotRef, log_lineage_run
from lightning_dagster.registry.roles import Roles, load_roles
from lightning_dagster.registry.tracking import ensure_tracking_store, is_http, probe

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "lightning-dagster-policy"
APPROVED = "approved-default"
LATEST = "latest-candidate"
ALIASES = (APPROVED, LATEST)
DEFAULT_APPROVER = "default-approver"
HISTORY_TAG_ENTRIES = 20  # the MLflow mirror keeps the newest moves; the store keeps all of them
VERIFIED_MARKER = ".ld-verified"


@dataclass(frozen=True)
class ResolvedVersion:
    version: str
    weights_hash: str
    local_path: Path | None


@dataclass(frozen=True)
class ReconcileResult:
    pointer: str | None
    alias_before: str | None
    changed: bool
    last_move: Any = None  # the store's newest PointerMove of approved-default, None if never set
    model_version: Any = None  # MLflow's version behind the alias, when the mirror was already current


@dataclass(frozen=True)
class PromotionResult:
    move: Any  # store.PointerMove
    mirrored: bool
    mirror_error: str | None = None


@dataclass
class DrillResult:
    """What a rollback drill proved; `error` says why a step is False. Unreachable MLflow -> resolved False."""

    version: str
    resolved: bool = False
    hash_ok: bool = False
    loaded: bool = False
    served: bool = False
    seconds: float = 0.0
    weights_hash: str | None = None
    reply: str | None = None
    error: str | None = None
    unavailable: bool = False  # MLflow could not be reached: evidence missing, not a failed parent
    at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return self.resolved and self.hash_ok and self.loaded and self.served

    def to_receipt_drill(self, parent_id: str, environment: str = "registry drill gateway") -> Any:
        """The gate receipt's `RollbackDrill`: a step after the first failure was not tried (None), and an
        unreachable MLflow leaves resolution unavailable (None) rather than failed."""
        from lightning_dagster.gate.receipt import RollbackDrill

        def step(done: bool, tried: bool) -> bool | None:
            return True if done else (False if tried else None)

        resolved_tried = not self.unavailable
        loaded_tried = self.resolved and self.hash_ok
        return RollbackDrill(
            parent_id=parent_id,
            environment=environment,
            resolved=step(self.resolved and self.hash_ok, resolved_tried),
            loaded=step(self.loaded, loaded_tried),
            routed_back=step(self.served, self.loaded),
            at=self.at,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def checkpoint_hash(path: Path) -> str:
    from lightning_dagster.engine import checkpoint_hash as engine_hash

    return engine_hash(Path(path))


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
    ) -> None:
        if store is None:
            from lightning_dagster.store import Store

            store = Store()
        self.tracking_uri = tracking_uri or config.mlflow_tracking_uri()
        self.store = store
        self.model_name = model_name
        self.experiment_name = experiment_name
        # A SQL tracking store needs an explicit artifact location; a server proxies its own.
        self.artifact_root = (
            None if is_http(self.tracking_uri) else Path(artifact_root or config.mlflow_artifact_root())
        )
        self.cache_dir = Path(cache_dir) if cache_dir else config.home() / "registry-cache"
        self.roles_file = roles_file
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self._experiment_id: str | None = None
        self._model_ready = False

    # ---- names -------------------------------------------------------------------------------------
    def pointer_name(self, alias: str = APPROVED) -> str:
        """The store's pointer name: the bare alias for the default model, namespaced otherwise."""
        return alias if self.model_name == DEFAULT_MODEL_NAME else f"{self.model_name}/{alias}"

    def roles(self) -> Roles:
        return load_roles(self.roles_file)

    def _require_any(self, actor: str, roles: Sequence[str]) -> None:
        """`actor` must hold at least one of `roles` (the roles a receipt lets approve the default)."""
        table = self.roles()
        if not any(r in table.actors.get(actor, ()) for r in roles):
            raise NotAuthorized(actor, " or ".join(roles) or "<none named>", f"per {table.path}")

    # ---- MLflow plumbing ---------------------------------------------------------------------------
    def _mlflow(self, what: str, fn, *args, **kwargs):
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

    def _ready(self) -> None:
        """Reachability first (fast failure), then the store schema, experiment and registered model."""
        probe(self.tracking_uri)
        if self._model_ready:
            return
        ensure_tracking_store(self.tracking_uri)
        exp = self._mlflow("get experiment", self.client.get_experiment_by_name, self.experiment_name)
        if exp is None:
            location = self.artifact_root.resolve().as_uri() if self.artifact_root else None
            try:
                self._experiment_id = self.client.create_experiment(
                    self.experiment_name, artifact_location=location
                )
            except MlflowException as exc:  # another process created it first
                if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code) and "already exists" not in str(exc):
                    raise
                self._experiment_id = self.client.get_experiment_by_name(self.experiment_name).experiment_id
        else:
            self._experiment_id = exp.experiment_id
        try:
            self._mlflow("create registered model", self.client.create_registered_model, self.model_name)
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code) and "already exists" not in str(exc):
                raise
        self._model_ready = True

    def model_version(self, version: str):
        try:
            return self._mlflow(
                "get model version", self.client.get_model_version, self.model_name, str(version)
            )
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise UnknownVersion(self.model_name, str(version)) from exc
            raise

    # ---- lineage -----------------------------------------------------------------------------------
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
        receipt: Mapping[str, Any] | None = None,
        receipt_id: str | None = None,
        receipt_hash: str | None = None,
        code_revision: str = "",
        evaluator_version: str = "",
        orchestrator_run_id: str = "",
    ) -> CandidateVersion:
        """Log a trained candidate as a run and a registered version, then move `latest-candidate` to it.

        The parent must be a registered version: its weights hash is copied into the lineage."""
        self.reconcile()
        if receipt is not None and hasattr(receipt, "to_json_dict"):  # a gate Receipt
            from lightning_dagster.gate import receipt_hash as gate_receipt_hash

            receipt_hash = receipt_hash or gate_receipt_hash(receipt)
            receipt = receipt.to_json_dict()
        parent = self.model_version(parent_version)
        tags = {
            "kind": "candidate",
            "parent_version": str(parent_version),
            "parent_weights_hash": parent.tags.get("weights_hash", ""),
            "snapshot_key": snapshot_key,
            "receipt_id": receipt_id or (str(receipt.get("receipt_id", "")) if receipt else ""),
            "receipt_hash": receipt_hash or "",
            "code_revision": code_revision,
            "evaluator_version": evaluator_version,
            "orchestrator_run_id": orchestrator_run_id,
        }
        snapshots = [
            (SnapshotRef.of(train_snapshot), "training"),
            (SnapshotRef.of(heldout_snapshot), "evaluation"),
        ]
        candidate = self._register(
            Path(checkpoint_dir),
            run_name=f"candidate-{snapshot_key}",
            tags=tags,
            params=algorithm_config,
            metrics_per_step=metrics_per_step,
            snapshots=snapshots,
            receipt=receipt,
        )
        self._mlflow(
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
    ) -> CandidateVersion:
        """Register the first parent and make it `approved-default` (a pointer move by `actor`).

        Refused with `PointerConflict` if `approved-default` is already set: bootstrapping happens once."""
        self.reconcile()
        current = self.store.current_pointer(self.pointer_name())
        if current is not None:
            raise PointerConflict(self.pointer_name(), None, current)
        version = self._register(
            Path(checkpoint_dir),
            run_name="initial-parent",
            tags={"kind": "initial-parent", "code_revision": code_revision},
            params={},
        )
        self._move(
            expected=None, to=version.version, weights_hash=version.weights_hash, actor=actor, note=note
        )
        self._mirror_after_move()
        return version

    def _register(
        self,
        checkpoint_dir: Path,
        *,
        run_name: str,
        tags: Mapping[str, str],
        params: Mapping[str, Any],
        metrics_per_step: Sequence[Mapping[str, float]] = (),
        snapshots: Sequence[tuple[SnapshotRef, str]] = (),
        receipt: Mapping[str, Any] | None = None,
    ) -> CandidateVersion:
        """One function for both kinds of version: hash, run with lineage, registered version with tags."""
        if not checkpoint_dir.is_dir():
            raise RegistryError(f"checkpoint directory {checkpoint_dir} does not exist")
        weights_hash = checkpoint_hash(checkpoint_dir)
        all_tags = {k: str(v) for k, v in tags.items() if v not in (None, "")} | {
            "weights_hash": weights_hash
        }
        run_id, source = self._mlflow(
            "log lineage run",
            log_lineage_run,
            self.client,
            self._experiment_id,
            run_name=run_name,
            checkpoint_dir=checkpoint_dir,
            params=params,
            tags=all_tags,
            metrics_per_step=metrics_per_step,
            snapshots=snapshots,
            receipt=receipt,
        )
        mv = self._mlflow(
            "create model version",
            self.client.create_model_version,
            self.model_name,
            source,
            run_id=run_id,
            tags=all_tags,
        )
        return CandidateVersion(
            version=str(mv.version),
            run_id=run_id,
            weights_hash=weights_hash,
            model_uri=f"models:/{self.model_name}/{mv.version}",
        )

    # ---- pointers ----------------------------------------------------------------------------------
    def reconcile(self) -> ReconcileResult:
        """Make MLflow's `approved-default` alias and tags agree with the store's pointer and history.

        The mirror is current when the alias names the store's version and that version's
        `approved-default.seq` tag is the store's newest move (one MLflow call). Idempotent; re-reads the
        store after writing so that a move made meanwhile is mirrored too."""
        self._ready()
        name = self.pointer_name()
        for _ in range(3):
            history = self.store.pointer_history(name)
            last = history[-1] if history else None
            pointer = last.to_value if last else None
            mv = self._alias_version(APPROVED)
            alias = None if mv is None else str(mv.version)
            seq = "" if mv is None else mv.tags.get(f"{APPROVED}.seq", "")
            if alias == pointer and seq == (str(last.seq) if last else ""):
                return ReconcileResult(pointer, alias, changed=False, last_move=last, model_version=mv)
            self._write_mirror(history, alias)
            if self.store.current_pointer(name) == pointer:
                break
        return ReconcileResult(pointer, alias, changed=True, last_move=last)

    def _alias_version(self, alias: str):
        """The model version an MLflow alias points at, or None if the alias is not set."""
        try:
            return self._mlflow("get alias", self.client.get_model_version_by_alias, self.model_name, alias)
        except MlflowException as exc:  # RestException from a server, MlflowException from a SQL store
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def _write_mirror(self, history: list, alias: str | None) -> None:
        # Tags first, alias last, and the alias's version carries the move's seq: an interrupted write
        # leaves the alias or its seq behind the store, so the next reconcile redoes all of it.
        c, m = self.client, self.model_name
        if not history:
            if alias is not None:
                self._mlflow("delete alias", c.delete_registered_model_alias, m, APPROVED)
            return
        last = history[-1]
        # Never mirror the pointer onto other weights than were approved (a re-created registered model
        # reuses version numbers): MLflow would then advertise a model nobody approved.
        approved_hash = _note(last).get("weights_hash")
        actual_hash = self.model_version(last.to_value).tags.get("weights_hash", "")
        if approved_hash and approved_hash != actual_hash:
            raise WeightsMismatch(last.to_value, approved_hash, actual_hash)
        for key, value in {
            f"{APPROVED}.approved_by": last.actor,
            f"{APPROVED}.approved_at": _iso(last.moved_at),
            f"{APPROVED}.receipt_id": last.receipt_id or "",
            f"{APPROVED}.seq": str(last.seq),
        }.items():
            self._mlflow("set version tag", c.set_model_version_tag, m, last.to_value, key, value)
        entries = [_move_dict(mv) for mv in history[-HISTORY_TAG_ENTRIES:]]
        self._mlflow("set tag", c.set_registered_model_tag, m, f"{APPROVED}.history", json.dumps(entries))
        self._mlflow("set tag", c.set_registered_model_tag, m, f"{APPROVED}.moves", str(len(history)))
        self._mlflow("set alias", c.set_registered_model_alias, m, APPROVED, last.to_value)

    def _mirror_after_move(self) -> str | None:
        """Mirror a move the store already made; an MLflow failure is reported, not raised (the move stands
        and the next operation's reconcile repairs the mirror)."""
        try:
            self.reconcile()
            return None
        except (RegistryUnavailable, MlflowException, OSError) as exc:
            log.warning("approved-default moved in the store but not yet mirrored to MLflow: %s", exc)
            return str(exc)

    def _move(self, *, expected: str | None, to: str, weights_hash: str, actor: str, note: str = "", **extra):
        body = {"weights_hash": weights_hash, "model": self.model_name, "note": note, **extra}
        return self.store.move_pointer(
            self.pointer_name(),
            expected=expected,
            to=str(to),
            actor=actor,
            receipt_id=extra.get("receipt_id"),
            note=json.dumps(body, sort_keys=True),
        )

    def current(self, alias: str = APPROVED) -> str | None:
        """The version an alias points at, or None; `approved-default` is read from the store."""
        _check_alias(alias)
        if alias == APPROVED:
            return self.store.current_pointer(self.pointer_name())
        mv = self._alias_version(alias)
        return None if mv is None else str(mv.version)

    def resolve(self, alias: str = APPROVED, *, download: bool = True) -> ResolvedVersion:
        """The version behind `alias`, with its verified local checkpoint when `download`.

        `approved-default` comes only from the store's pointer: if it was never set this raises
        `PointerNotSet`; it never falls back to `latest-candidate` or to the newest version."""
        _check_alias(alias)
        self._ready()
        # Only the newest move is read; the full history is read (by `reconcile`) only when the MLflow
        # mirror is behind the store and must be rewritten.
        moves = self.store.pointer_history(self.pointer_name(), last=1)
        last = moves[-1] if moves else None
        pointer = last.to_value if last else None
        approved = self._alias_version(APPROVED)
        alias_of = None if approved is None else str(approved.version)
        seq = "" if approved is None else approved.tags.get(f"{APPROVED}.seq", "")
        if alias_of != pointer or seq != (str(last.seq) if last else ""):
            rec = self.reconcile()
            last, pointer, approved = rec.last_move, rec.pointer, rec.model_version
        mv = approved if alias == APPROVED else self._alias_version(alias)
        version = pointer if alias == APPROVED else (None if mv is None else str(mv.version))
        if version is None:
            raise PointerNotSet(alias)
        if mv is None or str(mv.version) != version:
            mv = self.model_version(version)
        weights_hash = mv.tags.get("weights_hash", "")
        if alias == APPROVED:
            # Version numbers restart when a registered model is re-created; the content hash recorded at
            # approval time is what the pointer really means.
            approved_hash = _note(last).get("weights_hash")
            if approved_hash and approved_hash != weights_hash:
                raise WeightsMismatch(version, approved_hash, weights_hash)
        path = self._download(mv) if download else None
        return ResolvedVersion(version=version, weights_hash=weights_hash, local_path=path)

    def download(self, version: str) -> Path:
        """The version's checkpoint in the local cache, its bytes verified against the registered hash."""
        self._ready()
        return self._download(self.model_version(version))

    def _download(self, mv) -> Path:
        expected = mv.tags.get("weights_hash")
        if not expected:
            raise RegistryError(
                f"version {mv.version} has no weights_hash tag; it was not registered by this registry"
            )
        target = self.cache_dir / self.model_name / expected.replace(":", "-")
        if target.is_dir():
            actual = checkpoint_hash(target)  # re-verified on every use: a cache can be tampered with too
            if actual == expected:
                return target
            shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
        try:
            self._mlflow(
                "download artifacts", self.client.download_artifacts, mv.run_id, "checkpoint", str(tmp)
            )
            actual = checkpoint_hash(tmp / "checkpoint")
            if actual != expected:
                raise WeightsMismatch(str(mv.version), expected, actual)
            try:
                os.rename(tmp / "checkpoint", target)
            except OSError:  # another process put the same bytes there first
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def history(self) -> list:
        """The append-only history of `approved-default` moves (from the store)."""
        return self.store.pointer_history(self.pointer_name())

    # ---- approval and promotion --------------------------------------------------------------------
    def approve(self, receipt: Any, actor: str, role: str) -> receipts.StoredReceipt:
        """Record `actor`'s approval in `role` as a new receipt version; refuse an actor without the role
        (per the roles file) or a role the receipt does not name."""
        self.roles().require(actor, role)
        return receipts.record_approval(self.store, receipt, actor=actor, role=role)

    def promote(
        self,
        receipt: Any,
        actor: str,
        *,
        policy: Any = None,
        current_fingerprints: Mapping[str, str | None] | None = None,
    ) -> PromotionResult:
        """Move `approved-default` from the receipt's parent to its candidate, or refuse with the reason.

        Requires: the gate, run now on the ledger's head version under `policy` (default: the packaged
        one) with `current_fingerprints`, says promote and voids no check; `actor` holds a default-approver
        role the receipt names; the candidate is registered with the receipt's weights; and
        `approved-default` is exactly the receipt's parent (version and weights). The store's transaction
        is the compare-and-set (`PointerConflict` if another promotion moved it first); MLflow is mirrored
        afterwards."""
        from lightning_dagster.gate import PROMOTE, Policy, evaluate, load_policy

        self.reconcile()
        stored = receipts.load(self.store, receipt)
        facts = receipts.facts(stored.receipt, self.model_name)
        policy = policy if isinstance(policy, Policy) else load_policy(policy)
        evaluation = evaluate(stored.receipt, policy, current_fingerprints)
        if evaluation.verdict != PROMOTE or evaluation.stale_checks:
            raise PromotionRefused(
                f"receipt {facts.receipt_id} (version {stored.version}) is {evaluation.verdict} under "
                f"{policy.version}: " + "; ".join(evaluation.hold_reasons)
            )
        self._require_any(actor, facts.default_approver_roles)
        candidate = self.model_version(facts.candidate_version)
        weights_hash = candidate.tags.get("weights_hash", "")
        if facts.candidate_weights_hash and not receipts.same_hash(
            facts.candidate_weights_hash, weights_hash
        ):
            raise PromotionRefused(
                f"candidate version {facts.candidate_version} has weights {weights_hash}, "
                f"the receipt names {facts.candidate_weights_hash}"
            )
        # The exact parent: the pointer must hold the receipt's parent version, and the weights recorded
        # when it was approved must be the receipt's parent weights (version numbers can be reused).
        history = self.history()
        current = history[-1].to_value if history else None
        approved_hash = _note(history[-1]).get("weights_hash") if history else None
        if facts.parent_version is not None and current != facts.parent_version:
            raise PointerConflict(self.pointer_name(), facts.parent_version, current)
        if facts.parent_weights_hash and not receipts.same_hash(approved_hash, facts.parent_weights_hash):
            raise PointerConflict(
                self.pointer_name(), f"weights {facts.parent_weights_hash}", f"{current} ({approved_hash})"
            )
        move = self._move(
            expected=current,
            to=facts.candidate_version,
            weights_hash=weights_hash,
            actor=actor,
            note="promotion",
            receipt_id=facts.receipt_id,
            receipt_hash=stored.content_hash,
            receipt_version=stored.version,
            policy=f"{policy.version} {policy.hash}",
        )
        error = self._mirror_after_move()
        return PromotionResult(move=move, mirrored=error is None, mirror_error=error)

    # ---- rollback ----------------------------------------------------------------------------------
    def rollback(self, to_version: str, actor: str, *, role: str = DEFAULT_APPROVER) -> PromotionResult:
        """Move `approved-default` back to a version it held before, after proving that version serves.

        The target must appear in the pointer history as an earlier approved value (never "the newest
        version"); its bytes are verified, it is loaded and answers one chat completion through a
        gateway, and only then does the pointer move, with a history entry."""
        self.reconcile()
        self.roles().require(actor, role)
        to_version = str(to_version)
        history = self.history()
        current = history[-1].to_value if history else None
        approved_before = {m.to_value for m in history[:-1]}
        if to_version == current:
            raise PromotionRefused(f"version {to_version} is already approved-default")
        if to_version not in approved_before:
            raise PromotionRefused(
                f"version {to_version} was never approved-default; rollback only goes back"
            )
        mv = self.model_version(to_version)
        approved_hashes = {_note(m).get("weights_hash") for m in history if m.to_value == to_version}
        weights_hash = mv.tags.get("weights_hash", "")
        if weights_hash not in approved_hashes:
            raise WeightsMismatch(to_version, ",".join(sorted(h for h in approved_hashes if h)), weights_hash)
        path = self._download(mv)
        from lightning_dagster.registry.serving import serve_once

        serve_once(path)
        move = self._move(
            expected=current, to=to_version, weights_hash=weights_hash, actor=actor, note="rollback"
        )
        error = self._mirror_after_move()
        return PromotionResult(move=move, mirrored=error is None, mirror_error=error)

    def rollback_drill(self, parent_version: str, *, record: bool = True) -> DrillResult:
        """Resolve, verify, load and serve `parent_version` in a temporary gateway; the pointer stays put.

        Every failure is captured in the result (check 7 reads it): an unreachable MLflow gives
        `resolved=False` with the error, never a healthy-looking result."""
        from lightning_dagster.registry.serving import serve_once

        result = DrillResult(version=str(parent_version))
        start = time.perf_counter()
        try:
            self._ready()
            mv = self.model_version(str(parent_version))
            result.resolved = True
            result.weights_hash = mv.tags.get("weights_hash")
            path = self._download(mv)
            result.hash_ok = True
            result.reply = serve_once(path, on_loaded=lambda: setattr(result, "loaded", True))
            result.served = True
        except Exception as exc:  # the drill reports; it does not raise
            result.error = f"{type(exc).__name__}: {exc}"
            result.unavailable = isinstance(exc, RegistryUnavailable)
        result.seconds = round(time.perf_counter() - start, 3)
        if record:
            receipts.record_drill(self.store, self.model_name, result.to_dict())
        return result

    # ---- inspection --------------------------------------------------------------------------------
    def show(self) -> dict[str, Any]:
        """Both pointers, the MLflow mirror's view, and the registered versions (newest first)."""
        rec = self.reconcile()
        rm = self.client.get_registered_model(self.model_name)
        versions = self.client.search_model_versions(f"name='{self.model_name}'", max_results=200)
        return {
            "model": self.model_name,
            "tracking_uri": self.tracking_uri,
            APPROVED: rec.pointer,
            "mlflow_alias_" + APPROVED.replace("-", "_"): _alias(rm, APPROVED),
            LATEST: _alias(rm, LATEST),
            "versions": [
                {
                    "version": str(v.version),
                    **{
                        k: v.tags.get(k, "")
                        for k in ("kind", "weights_hash", "parent_version", "snapshot_key", "receipt_id")
                    },
                }
                for v in sorted(versions, key=lambda v: int(v.version), reverse=True)
            ],
        }


def _check_alias(alias: str) -> None:
    if alias not in ALIASES:
        raise ValueError(
            f"unknown alias {alias!r}; expected one of {ALIASES} ('latest' is reserved by MLflow)"
        )


def _alias(registered_model, alias: str) -> str | None:
    """MLflow returns alias targets as ints from some stores and strings from others."""
    version = registered_model.aliases.get(alias)
    return None if version is None else str(version)


def _note(move) -> dict[str, Any]:
    try:
        return json.loads(move.note or "{}")
    except ValueError:
        return {}


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(ts)))


def _move_dict(move) -> dict[str, Any]:
    return {
        "seq": move.seq,
        "from": move.from_value,
        "to": move.to_value,
        "actor": move.actor,
        "receipt_id": move.receipt_id,
        "at": _iso(move.moved_at),
    }


def _is_connection_error(exc: MlflowException) -> bool:
    text = str(exc)
    return any(
        s in text for s in ("Max retries exceeded", "Connection refused", "ConnectionError", "API request to")
    )
