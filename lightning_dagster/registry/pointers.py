"""The two pointers: `latest-candidate` (an MLflow alias) and `approved-default`, which lives in the store
(compare-and-set, append-only history) and is mirrored to MLflow as an alias plus tags, since MLflow aliases
have neither. `reconcile` makes the mirror agree with the store at the start of every operation, so a mirror
write lost to an outage heals.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.exceptions import MlflowException

from lightning_dagster.registry import incidents
from lightning_dagster.registry.errors import (
    CheckpointFilesMismatch,
    PointerNotSet,
    RegistryError,
    RegistryUnavailable,
    WeightsMismatch,
)
from lightning_dagster.registry.lineage import CandidateVersion

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry

log = logging.getLogger(__name__)

APPROVED = "approved-default"
LATEST = "latest-candidate"
ALIASES = (APPROVED, LATEST)
HISTORY_TAG_ENTRIES = 20  # the MLflow mirror keeps the newest moves; the store keeps all of them
# A version tag, "true" on the version `approved-default` points at and "false" on those it left: MLflow's
# model list shows one alias per version and hides the rest behind "+1", but lists tags and filters on them.
APPROVED_FLAG = "approved_default"


@dataclass(frozen=True)
class ResolvedVersion:
    version: str
    weights_hash: str
    local_path: Path | None
    model_uri: str  # `models:/<model>/<version>`, for receipts that name the parent by URI


@dataclass(frozen=True)
class ReconcileResult:
    pointer: str | None
    changed: bool
    last_move: Any = None  # the store's newest PointerMove of approved-default, None if never set
    model_version: Any = None  # MLflow's version behind the alias, when the mirror was already current
    incident: Any = None  # the `PointerIncident` recorded when the alias had been moved outside the registry
    differences: Any = None  # with `check_only`: what the mirror shows otherwise than the store
    chain: Any = None  # the verified history (`release.chain.Chain`): the mirror shows its last verified move


def check_alias(alias: str) -> None:
    if alias not in ALIASES:
        raise ValueError(
            f"unknown alias {alias!r}; expected one of {ALIASES} ('latest' is reserved by MLflow)"
        )


def approved_hash(move: Any, kind: str = "weights_hash") -> str | None:
    """The weights (or files) hash recorded with `move`: version numbers can be reused, this cannot."""
    return None if move is None else move_note(move).get(kind)


def move_note(move: Any) -> dict[str, Any]:
    """The JSON body recorded with a pointer move; {} for a note not written by the registry."""
    try:
        body = json.loads(move.note or "{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def move_dict(move: Any) -> dict[str, Any]:
    """One pointer move as the mirror's history tag and the command's JSON show it."""
    return {
        "seq": move.seq,
        "from": move.from_value,
        "to": move.to_value,
        "actor": move.actor,
        "receipt_id": move.receipt_id,
        "at": iso(move.moved_at),
    }


def iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(ts)))


def mirror_flag(pointer: str) -> str:
    """The store flag holding what the registry last wrote to (or verified in) the mirror."""
    return f"mirror/{pointer}"


@dataclass(frozen=True)
class MirrorState:
    """What MLflow shows of `approved-default`, read in three calls."""

    alias_version: Any  # MLflow's ModelVersion behind the alias, None when the alias is unset
    model_tags: dict[str, str]
    description: str
    flagged: frozenset[str]  # versions whose `approved_default` tag is "true"

    @property
    def alias(self) -> str | None:
        return None if self.alias_version is None else str(self.alias_version.version)


def _flagged(reg: Registry) -> set[str]:
    query = f"name='{reg.model_name}' and tags.{APPROVED_FLAG} = 'true'"
    found = reg.call_mlflow("search versions", reg.client.search_model_versions, query)
    return {str(v.version) for v in found}


def read_mirror(reg: Registry) -> MirrorState:
    mv = reg.alias_version(APPROVED)
    rm = reg.call_mlflow("get registered model", reg.client.get_registered_model, reg.model_name)
    return MirrorState(mv, dict(rm.tags or {}), rm.description or "", frozenset(_flagged(reg)))


def version_tags(last: Any) -> dict[str, str]:
    return {
        APPROVED_FLAG: "true",
        f"{APPROVED}.approved_by": last.actor,
        f"{APPROVED}.approved_at": iso(last.moved_at),
        f"{APPROVED}.receipt_id": last.receipt_id or "",
        f"{APPROVED}.seq": str(last.seq),
    }


def model_tags(history: list) -> dict[str, str]:
    entries = [move_dict(mv) for mv in history[-HISTORY_TAG_ENTRIES:]]
    return {f"{APPROVED}.history": json.dumps(entries), f"{APPROVED}.moves": str(len(history))}


def _shown(value: Any) -> str:
    text = "(unset)" if value is None else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def mirror_differences(history: list, found: MirrorState) -> list[str]:
    """Every mirrored field MLflow shows otherwise than the store's history says; [] when exact."""
    last = history[-1] if history else None
    diffs: list[str] = []

    def compare(field: str, actual: Any, expected: Any) -> None:
        if actual != expected:
            diffs.append(f"{field}: found {_shown(actual)}, the store says {_shown(expected)}")

    compare("alias", found.alias, None if last is None else last.to_value)
    if last is None:
        compare("versions flagged approved", sorted(found.flagged), [])
        return diffs
    tags = {} if found.alias_version is None else dict(found.alias_version.tags or {})
    for key, value in version_tags(last).items():
        compare(f"version tag {key}", tags.get(key), value)
    for key, value in model_tags(history).items():
        compare(f"model tag {key}", found.model_tags.get(key), value)
    compare("description", found.description, description(last))
    compare("versions flagged approved", sorted(found.flagged), [last.to_value])
    return diffs


def reconcile(
    reg: Registry, *, last_verified: float | None = None, check_only: bool = False
) -> ReconcileResult:
    """Make MLflow's `approved-default` mirror agree with the store, rewriting it when anything differs. A
    mirror the registry cannot have left so (`_explained`, `_written`) is recorded as a `PointerIncident`
    first. `last_verified` narrows the incident's window; `check_only` writes nothing."""
    reg.connect()
    incident = None
    for _ in range(3):
        # Read in the reverse order of the registry's writes (store move, mirror, flag): any mirror the
        # registry wrote is backed by the flag and history read here. Only verified moves are mirrored.
        mirrored = reg.store.get_flag(mirror_flag(reg.pointer_name()))
        found = read_mirror(reg)
        chain = reg.verified()
        history, last, pointer = chain.moves, chain.head, chain.value
        alias = found.alias
        differences = mirror_differences(history, found)
        if check_only:
            return ReconcileResult(
                pointer, changed=bool(differences), last_move=last, differences=differences, chain=chain
            )
        if not differences:
            _note_mirrored(reg, last, mirrored)
            return ReconcileResult(
                pointer, False, last, model_version=found.alias_version, incident=incident, chain=chain
            )
        tampered = incident is None and (not _explained(alias, history, mirrored) or _written(last, mirrored))
        try:
            _write_mirror(reg, history, alias)
        except (RegistryError, MlflowException, OSError) as exc:
            if tampered:
                _incident(reg, alias, last, mirrored, last_verified, differences, error=str(exc))
            raise
        _note_mirrored(reg, last, mirrored)
        if tampered:
            incident = _incident(reg, alias, last, mirrored, last_verified, differences)
        if reg.store.pointer_state(reg.pointer_name()) == chain.row:
            break
    return ReconcileResult(pointer, changed=True, last_move=last, incident=incident, chain=chain)


def _written(last: Any, mirrored: dict | None) -> bool:
    """Whether the registry wrote (or verified) the mirror of the newest move: only others change it then."""
    return last is not None and mirrored is not None and mirrored.get("seq") == last.seq


def _explained(alias: str | None, history: list, mirrored: dict | None) -> bool:
    """Whether the registry can have left the alias so: unset, or a value held since its last mirror write."""
    if mirrored is None:
        return alias is None or alias in {m.to_value for m in history}
    return alias is not None and alias in {m.to_value for m in history if m.seq >= mirrored["seq"]}


def _note_mirrored(reg: Registry, last: Any, mirrored: dict | None) -> None:
    if last is not None and (mirrored or {}).get("seq") != last.seq:
        reg.store.set_flag(
            mirror_flag(last.name), {"seq": last.seq, "version": last.to_value, "at": time.time()}
        )


def _incident(
    reg: Registry,
    alias: str | None,
    last: Any,
    mirrored: dict | None,
    last_verified: float | None,
    differences: list[str],
    error: str | None = None,
) -> incidents.PointerIncident:
    since = [t for t in ((mirrored or {}).get("at"), last_verified) if t is not None]
    incident = incidents.record(
        reg.store,
        incidents.PointerIncident(
            pointer=reg.pointer_name(),
            model=reg.model_name,
            alias=APPROVED,
            found_version=alias,
            store_version=None if last is None else last.to_value,
            store_seq=None if last is None else last.seq,
            detected_at=time.time(),
            not_before=max(since) if since else None,
            restored=error is None,
            error=error,
            tampered=True,
            differences=list(differences),
        ),
    )
    log.warning("pointer incident %d: %s", incident.number, incident.summary())
    return incident


def _write_mirror(reg: Registry, history: list, alias: str | None) -> None:
    # Tags first, alias last, and the alias's version carries the move's seq: an interrupted write leaves
    # the alias or its seq behind the store, so the next reconcile redoes all of it.
    c, m, call = reg.client, reg.model_name, reg.call_mlflow
    last = history[-1] if history else None
    # Never mirror the pointer onto other weights than were approved (a re-created registered model reuses
    # version numbers): MLflow would then advertise a model nobody approved.
    if last is not None:
        expected, actual = approved_hash(last), reg.model_version(last.to_value).weights_hash
        if expected and expected != actual:
            raise WeightsMismatch(last.to_value, expected, actual)
    for left in _flagged(reg) - {last.to_value if last else None}:
        call("set version tag", c.set_model_version_tag, m, left, APPROVED_FLAG, "false")
    if last is None:
        if alias is not None:
            call("delete alias", c.delete_registered_model_alias, m, APPROVED)
        return
    for key, value in version_tags(last).items():
        call("set version tag", c.set_model_version_tag, m, last.to_value, key, value)
    for key, value in model_tags(history).items():
        call("set tag", c.set_registered_model_tag, m, key, value)
    call("update description", c.update_registered_model, m, description(last))
    call("set alias", c.set_registered_model_alias, m, APPROVED, last.to_value)


def description(last: Any) -> str:
    """The registered model's description: which version `approved-default` names, since when and why."""
    receipt = f", receipt {last.receipt_id}" if last.receipt_id else ""
    return (
        f"{APPROVED}: version {last.to_value} ({move_note(last).get('note') or 'moved'} by "
        f"{last.actor} at {iso(last.moved_at)}{receipt}). The registry's store holds this pointer; the "
        f"`{APPROVED}` alias and the `{APPROVED_FLAG}` version tag mirror it."
    )


def mirror_after_move(reg: Registry) -> str | None:
    """Mirror a move the store already made; an MLflow failure is reported, not raised."""
    try:
        reconcile(reg)
        return None
    except (RegistryUnavailable, MlflowException, OSError) as exc:
        log.warning("approved-default moved in the store but not yet mirrored to MLflow: %s", exc)
        return str(exc)


def move(
    reg: Registry, *, expected: str | None, expected_seq: int, to: str, actor: str, signed: dict, note: str = "",
    **extra,
) -> Any:  # fmt: skip
    """Compare-and-set `approved-default` on its value and move number `expected_seq` (0: never set), so even
    a move back to `expected` since (A -> B -> A) refuses this one. `signed`: `release.chain.move_note`."""
    body = {"model": reg.model_name, "note": note, **extra, **signed}
    return reg.store.move_pointer(
        reg.pointer_name(),
        expected=expected,
        expected_seq=expected_seq,
        to=str(to),
        actor=actor,
        receipt_id=extra.get("receipt_id"),
        note=json.dumps(body, sort_keys=True),
    )


def current(reg: Registry, alias: str = APPROVED) -> str | None:
    """The version an alias points at, or None; `approved-default` is the store's last verified move."""
    check_alias(alias)
    if alias == APPROVED:
        return reg.verified().value
    mv = reg.alias_version(alias)
    return None if mv is None else str(mv.version)


def resolve(reg: Registry, alias: str = APPROVED, *, download: bool = True) -> ResolvedVersion:
    """The version behind `alias` (with its checkpoint); `approved-default` only from verified history."""
    check_alias(alias)
    reg.connect()
    last = None  # the store's move behind `approved-default`
    if alias == APPROVED:
        chain = reg.verified().require()
        last, version, mv = chain.head, chain.value, reg.alias_version(APPROVED)
        seq = mv.tags.get(f"{APPROVED}.seq", "") if mv else ""
        if (None if mv is None else str(mv.version)) != version or seq != (str(last.seq) if last else ""):
            rec = reconcile(reg)
            last, version, mv = rec.last_move, rec.pointer, rec.model_version
    else:
        mv = reg.alias_version(alias)
        version = None if mv is None else str(mv.version)
    if version is None:
        raise PointerNotSet(alias)
    typed = (
        CandidateVersion.of(mv, reg.model_name)
        if mv is not None and str(mv.version) == version
        else reg.model_version(version)
    )
    # Version numbers restart when a registered model is re-created; the content hash recorded at approval
    # time is what the pointer really means. Likewise the checkpoint files: a version whose `files_hash` tag
    # was rewritten or removed after approval would otherwise be fetched against the new tag (or none).
    if (expected := approved_hash(last)) and expected != typed.weights_hash:
        raise WeightsMismatch(version, expected, typed.weights_hash)
    if (expected := approved_hash(last, "files_hash")) and expected != typed.files_hash:
        raise CheckpointFilesMismatch(version, expected, typed.files_hash or "(none recorded)")
    return ResolvedVersion(
        typed.version, typed.weights_hash, reg.fetch(typed) if download else None, typed.model_uri
    )
