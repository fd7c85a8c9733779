"""The update receipt in one namespace: its schema (`receipt_models`) and pure builders (`receipt_builders`),
used as `from lightning_dagster.gate import receipt as R`.
"""

from lightning_dagster.gate.receipt_builders import *  # noqa: F403
from lightning_dagster.gate.receipt_models import *  # noqa: F403
