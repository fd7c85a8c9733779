"""The layering the code promises: core packages never load Dagster, the engine never loads a harness, and
no module grows past what a reader can hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dagster"
CORE = (
    "store",
    "gateway",
    "engine",
    "runner",
    "harnesses",
    "training",
    "gate",
    "release",
    "registry",
    "pipeline",
    "project",
)
MAX_LINES = 450

# Imports every module of the given packages (except their CLIs when asked), then prints which of the
# watched top-level packages ended up loaded.
PROBE = """
import importlib, pkgutil, sys
skip_cli = sys.argv[1] == "1"
watched = sys.argv[2].split(",")
for name in sys.argv[3:]:
    pkg = importlib.import_module(name)
    for info in pkgutil.walk_packages(pkg.__path__, name + "."):
        if ".migrations" in info.name or (skip_cli and info.name.endswith(".cli")):
            continue
        importlib.import_module(info.name)
print(",".join(w for w in watched if w in sys.modules))
"""


def loaded_after_import(packages: list[str], watched: list[str], *, skip_cli: bool = False) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if skip_cli else "0", ",".join(watched), *packages],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        timeout=300,
    ).stdout.strip()
    return [w for w in out.split(",") if w]


def test_no_core_package_loads_dagster_directly_or_through_a_helper():
    assert loaded_after_import([f"lightning_dagster.{p}" for p in CORE], ["dagster"]) == []


def test_the_engine_loads_no_harness_outside_its_cli():
    assert (
        loaded_after_import(["lightning_dagster.engine"], ["lightning_dagster.harnesses"], skip_cli=True)
        == []
    )


def test_the_probe_sees_a_package_that_does_load_dagster():
    # The Dagster wiring does load it: without this, an empty probe output would pass the tests above.
    assert loaded_after_import(["lightning_dagster.orchestration.assets"], ["dagster"]) == ["dagster"]


def test_no_module_is_longer_than_a_reader_can_hold():
    sizes = {
        str(path.relative_to(ROOT)): sum(1 for line in path.read_text().splitlines() if line.strip())
        for path in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 50  # the walk found the package
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}
