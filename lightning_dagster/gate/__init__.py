"""The release gate: an immutable three-phase update receipt (`receipt`), seven checks (`check_ids`, `checks`)
under a versioned policy (`policy`), cross-field consistency, staleness, stop conditions and the receipt
ledger. Pure logic: no torch, Dagster or MLflow imports.
"""

from lightning_dagster.gate.checks import PROMOTE as PROMOTE
from lightning_dagster.gate.checks import evaluate as evaluate
from lightning_dagster.gate.ledger import ReceiptLedger as ReceiptLedger
from lightning_dagster.gate.policy import load_policy as load_policy
from lightning_dagster.gate.receipt import load_receipt as load_receipt
from lightning_dagster.gate.receipt import parse_receipt as parse_receipt
