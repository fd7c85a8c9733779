"""The release gate: an immutable three-phase update receipt, seven checks under a versioned policy,
staleness and stop conditions. Pure logic: no torch, Dagster or MLflow imports.

- `check_ids`: `Check`, the seven checks' one table (number, machine name, title, description).
- `receipt`: the schema (`receipt_models`: `parse_receipt`/`load_receipt`, `receipt_hash`) and the pure
  builders (`receipt_builders`: `from_plan`, `add_rollout_evidence`, `add_candidate`, `add_evaluation`,
  `add_canary`, `add_rollback_drill`, `add_approval`, `set_fingerprints`, `with_gate_record`).
- `policy`: `load_policy(path=None)` (None: packaged `policies/default-v1.yaml`), `Policy.hash`.
- `consistency`: `inconsistencies(receipt, roles=None, now=None, clock_skew_s=CLOCK_SKEW_S)`, the
  cross-field validations run before judging; a contradiction fails the check it touches.
- `checks`: `run_check(check, receipt, policy, *, roles, now, clock_skew_s) -> CheckResult` (bodies in
  `evidence_checks` and `release_checks`), `evaluate(receipt, policy, current_fingerprints=None, *, roles,
  now, clock_skew_s) -> Evaluation`.
- `staleness`: `void_checks(recorded, current)` and the fingerprint -> checks table.
- `stop`: `stop_decision(latest, policy, previous=None) -> StopDecision`.
- `ledger`: `ReceiptLedger(store)` over the store's append-only documents; `verify_chain`.
- `cli`: `lightning-dagster gate evaluate RECEIPT [--policy-path P] [--roles-path R] [--fingerprints F] [--json]`.
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
