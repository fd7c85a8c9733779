"""The release gate: an immutable three-phase update receipt, seven checks under a versioned policy,
staleness and stop conditions. Pure logic: no torch, Dagster or MLflow imports.

- `receipt`: the receipt schema and its pure builders (`from_plan`, `add_rollout_evidence`,
  `add_candidate`, `add_evaluation`, `add_canary`, `add_rollback_drill`, `add_approval`,
  `set_fingerprints`, `with_gate_record`), `parse_receipt`/`load_receipt`, `receipt_hash`.
- `policy`: `load_policy(path=None)` (None: packaged `policies/default-v1.yaml`), `Policy.hash`.
- `checks`: `evaluate(receipt, policy, current_fingerprints=None) -> Evaluation`.
- `staleness`: `void_checks(recorded, current)` and the fingerprint -> checks table.
- `stop`: `stop_decision(latest, policy, previous=None) -> StopDecision`.
- `ledger`: `ReceiptLedger(store)` over the store's append-only documents; `verify_chain`.
- `cli`: `lightning-dagster gate evaluate RECEIPT [--policy P] [--fingerprints F] [--json]`.
"""

from lightning_dagster.gate.checks import HOLD, PROMOTE, CheckResult, Evaluation, evaluate
from lightning_dagster.gate.errors import AmendmentError, InvalidInput, TamperedReceipt
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
    "stop_decision",
    "void_checks",
]
