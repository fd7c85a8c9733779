"""The release gate: an immutable three-phase update receipt (`receipt`), seven checks (`check_ids`, `checks`)
under a versioned policy (`policy`), cross-field consistency, staleness, stop conditions and the receipt
ledger. Pure logic: no torch, Dagster or MLflow imports.
"""

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import HOLD, PROMOTE, Evaluation, evaluate, run_check
from lightning_dagster.gate.errors import AmendmentError, InvalidInput, TamperedReceipt
from lightning_dagster.gate.findings import CheckResult
from lightning_dagster.gate.hashing import content_hash, fingerprint
from lightning_dagster.gate.ledger import ReceiptLedger
from lightning_dagster.gate.policy import Policy, load_policy, parse_policy
from lightning_dagster.gate.receipt import Receipt, load_receipt, parse_receipt, receipt_hash
from lightning_dagster.gate.staleness import void_checks
from lightning_dagster.gate.stop import StopDecision, stop_decision

__all__ = [
    "HOLD",
    "PROMOTE",
    "AmendmentError",
    "Check",
    "CheckResult",
    "Evaluation",
    "InvalidInput",
    "Policy",
    "Receipt",
    "ReceiptLedger",
    "StopDecision",
    "TamperedReceipt",
    "content_hash",
    "evaluate",
    "fingerprint",
    "load_policy",
    "load_receipt",
    "parse_policy",
    "parse_receipt",
    "receipt_hash",
    "run_check",
    "stop_decision",
    "void_checks",
]
