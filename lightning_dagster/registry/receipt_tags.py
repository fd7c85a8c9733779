"""The receipt on the model version it judged: version tags, and the same tags on its lineage run, naming the
ledger's head of that receipt (id, ledger version, ledger hash, verdict), rewritten at every new receipt
version; the run also gets the held-out and protected figures as metrics. `receipt_hash` is the ledger's
hash of that version, never the gate's evidence hash.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mlflow.exceptions import MlflowException

from lightning_dagster.gate.ledger import ReceiptLedger
from lightning_dagster.registry.checkpoints import same_hash
from lightning_dagster.registry.errors import RegistryError, WeightsMismatch

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import Receipt
    from lightning_dagster.registry.core import Registry

log = logging.getLogger(__name__)

PENDING = "pending"  # the verdict tag of a version whose receipt the gate has not judged yet


@dataclass(frozen=True)
class StoredReceipt:
    receipt: Receipt
    version: int  # the ledger version (1, 2, ...)
    content_hash: str  # the ledger's hash of that version (covers body and link)


def stored_head(store: Any, receipt_id: str) -> StoredReceipt | None:
    """The ledger's head version of a receipt, its chain verified; None if the ledger has none of it."""
    ledger = ReceiptLedger(store)
    entries = ledger.history(receipt_id)
    if not entries:
        return None
    return StoredReceipt(ledger.head(receipt_id, verify=True), entries[-1].version, entries[-1].content_hash)


@dataclass(frozen=True)
class ReceiptTags:
    model_version: str
    receipt_id: str
    receipt_version: int
    receipt_hash: str
    verdict: str  # the gate's verdict on that receipt version, or `PENDING`

    def as_tags(self) -> dict[str, str]:
        """The version tags: every field but the version they are on."""
        return {k: str(v) for k, v in asdict(self).items() if k != "model_version"}


def of_stored(stored: StoredReceipt) -> ReceiptTags | None:
    """The tags a stored receipt version gives its candidate's version; None before a candidate is recorded."""
    candidate, gate, rid = stored.receipt.candidate, stored.receipt.gate, stored.receipt.receipt_id
    if candidate is None or candidate.model_version is None:
        return None
    verdict = PENDING if gate is None else gate.verdict
    return ReceiptTags(candidate.model_version, rid, stored.version, stored.content_hash, verdict)


def recorded(reg: Registry, receipt_id: str, model_version: str) -> ReceiptTags | None:
    """What `model_version`'s tags record of receipt `receipt_id` (None: no version of it)."""
    tags = reg.call_mlflow("get version", reg.client.get_model_version, reg.model_name, model_version).tags
    number, digest = str(tags.get("receipt_version", "")), tags.get("receipt_hash", "")
    if tags.get("receipt_id") != receipt_id or not number.isdigit() or not digest:
        return None
    return ReceiptTags(model_version, receipt_id, int(number), digest, tags.get("verdict", ""))


def compare(reg: Registry, receipt_id: str, model_version: str) -> tuple[str | None, str, int]:
    """How the ledger and the version's tags disagree (None: not), what was compared, and their version."""
    try:
        tags = recorded(reg, receipt_id, model_version)
    except (RegistryError, MlflowException, OSError) as exc:
        return None, f"not consulted ({str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r})", 0
    if tags is None:
        return None, f"not consulted (model version {model_version} has no tags of this receipt)", 0
    held = {e.version: e.content_hash for e in ReceiptLedger(reg.store).history(receipt_id)}
    v, where = tags.receipt_version, f"MLflow's receipt tags on model version {model_version}"
    if held.get(v) == tags.receipt_hash:
        problem = None
    elif v not in held:
        problem = f"{where} record version {v} ({tags.receipt_hash}), which the ledger does not hold"
    else:
        problem = f"version {v} disagrees with {where}: the ledger holds {held[v]}, MLflow records {tags.receipt_hash}"
    return problem, f"{where} name receipt version {v}", v


def head(store: Any, receipt_id: str) -> tuple[int, str] | None:
    entries = ReceiptLedger(store).history(receipt_id)
    return (entries[-1].version, entries[-1].content_hash) if entries else None


def write(reg: Registry, value: str | StoredReceipt) -> ReceiptTags | None:
    """Tag the candidate's version with the receipt's ledger head (`WeightsMismatch`: other weights)."""
    stored = value if isinstance(value, StoredReceipt) else stored_head(reg.store, value)
    if stored is None:
        raise RegistryError(f"receipt {value!r} is not in the ledger")
    tags = of_stored(stored)
    if tags is None:
        return None
    version = reg.model_version(tags.model_version)
    named = stored.receipt.candidate.weights_hash if stored.receipt.candidate else None
    if named and not same_hash(named, version.weights_hash):
        raise WeightsMismatch(version.version, named, version.weights_hash)
    c, call = reg.client, reg.call_mlflow
    for key, text in tags.as_tags().items():
        call("set version tag", c.set_model_version_tag, reg.model_name, version.version, key, text)
        call("set run tag", c.set_tag, version.run_id, key, text)
    for key, value in evaluation_metrics(stored.receipt).items():
        call("log metric", c.log_metric, version.run_id, key, value)
    return tags


def evaluation_metrics(receipt: Receipt) -> dict[str, float]:
    """The receipt's held-out means and margin (over the families both sides ran) and protected counts."""
    out: dict[str, float] = {}
    scored = [
        f
        for f in (receipt.holdout.families if receipt.holdout else [])
        if None not in (f.candidate_mean, f.parent_mean)
    ]
    n = sum(f.n for f in scored)
    if n:
        for side in ("candidate", "parent"):
            out[f"heldout_{side}_mean"] = sum(f.n * getattr(f, f"{side}_mean") for f in scored) / n
        out["heldout_margin"] = out["heldout_candidate_mean"] - out["heldout_parent_mean"]
    if receipt.protected is not None:
        out["protected_cases"] = float(sum(f.n for f in receipt.protected.families))
        out["protected_regressions"] = float(sum(len(f.regressed) for f in receipt.protected.families))
    return out


def write_after(reg: Registry, value: str | StoredReceipt) -> str | None:
    """`write` after the store already changed: an MLflow failure is reported, not raised."""
    try:
        write(reg, value)
        return None
    except (RegistryError, MlflowException, OSError) as exc:
        log.warning("receipt recorded in the store but its version tags were not written: %s", exc)
        return str(exc)
