"""The code location the browser test serves: the real one with the tests' tiny training settings as its
defaults (the policy comes from `LD_GATE_POLICY`, the home and roles from the environment as usual)."""

from lightning_dagster.orchestration.definitions import build_definitions
from tests.dagster.conftest import tiny_training

defs = build_definitions(training=tiny_training())
