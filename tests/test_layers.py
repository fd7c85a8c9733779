"""The layering the code promises: only the Dagster wiring loads Dagster, no core module reaches for an
example agent, the package import graph is the one docs/ARCHITECTURE.md draws (every arrow against the
layering named import by import), and no module grows past what a reader can hold."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dagster"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
CORE = (
    "store",
    "gateway",
    "engine",
    "runner",
    "harnesses",
    "training",
    "gate",
    "registry",
    "release",
    "pipeline",
    "project",
    "settings",
    "paths",
    "types",
    "canonical",
    "model_folder",
)
# The only modules that may import Dagster: the wiring, and the demo that drives it.
DAGSTER_WIRING = ("lightning_dagster.orchestration", "lightning_dagster.demo")
# What only `lightning_dagster.harnesses` itself (and tests, benchmarks, scripts) may import.
EXAMPLE_CODE = ("examples", "lightning_dagster.harnesses")
MAX_LINES = 450

# The layering, bottom first: a package imports the ones before it. Every import of a later one is an arrow
# against the layering, so it closes a cycle unless it is declared in UPWARD; with all of them declared, the
# remaining arrows all point down and no undeclared cycle can exist.
ORDER = (
    "canonical",
    "paths",
    "types",
    "model_folder",
    "settings",
    "store",
    "engine",
    "gateway",
    "runner",
    "project",
    "harnesses",
    "training",
    "gate",
    "registry",
    "release",
    "pipeline",
    "orchestration",
    "demo",
    "cli",
    "__main__",
)
# The package import graph (every import statement, in functions and under TYPE_CHECKING too), exactly as
# docs/ARCHITECTURE.md shows it: a new arrow between packages is a deliberate change to both.
DECLARED: dict[str, set[str]] = {
    "canonical": set(),
    "paths": set(),
    "types": set(),
    "model_folder": set(),
    "settings": {"paths"},
    "store": {"paths", "types"},
    "engine": {"model_folder", "settings"},
    "gateway": {"engine", "paths", "settings", "store", "types"},
    "runner": {"engine", "gateway", "model_folder", "paths", "project", "settings", "store", "types"},
    "project": {"gate", "gateway", "model_folder", "runner", "settings"},
    "harnesses": {"project"},
    "training": {"engine", "gateway", "paths", "project", "runner", "settings", "store", "types"},
    "gate": {"canonical", "release", "settings", "store", "training", "types"},
    "registry": {"engine", "gate", "gateway", "paths", "release", "settings", "store"},
    "release": {"canonical", "gate", "paths", "registry", "settings", "store"},
    "pipeline": {
        "engine",
        "gate",
        "gateway",
        "paths",
        "project",
        "registry",
        "release",
        "runner",
        "settings",
        "store",
        "training",
        "types",
    },
    "orchestration": {"gate", "gateway", "pipeline", "registry", "release", "settings", "store", "training"},
    "demo": {"orchestration", "paths", "pipeline", "project", "registry", "release", "settings"},
    "cli": {"model_folder", "settings", "store"},
    "__main__": {"cli"},
}
# The imports against the layering, module by module (names below `lightning_dagster.`).
UPWARD: dict[str, set[str]] = {
    # The runner's commands take a project; the runner posts rewards the Agent Lightning way and runs a
    # built-in example when given no harness.
    "runner.cli": {"project", "project.cli", "project.harness", "project.splits"},
    "runner.runner": {"project.agl_launcher"},
    "runner.service": {"project.examples"},
    # A project's `gate.policy_path` is checked by loading it (in a function: only when one is given).
    "project.sections": {"gate.errors", "gate.policy"},
    # Check 7 verifies approvals through the release's pure modules, which import only `canonical`.
    "gate.consistency": {"release.approvals", "release.signing"},
    # The ledger lists each version's evidence hash, the value an approval signs.
    "gate.ledger": {"release.approvals"},
    # Every reader of approved-default verifies its signed history, and the bootstrap move is signed, by the
    # release's chain (in functions), which builds on the registry.
    "registry.core": {"release.chain"},
    # `gate evaluate --roles-path` reads a roles file (in a function: only when one is given); the pipeline's
    # public key is parsed by the pure signing module, derived from a private key file (in a function) only
    # when that is all the environment names; `gate verify` reads MLflow's receipt tags through the release
    # (in a function: only for a receipt that names its candidate's model version).
    "gate.cli": {
        "release.errors",
        "release.pipeline_key",
        "release.receipts",
        "release.roles",
        "release.signing",
    },
    # A receipt version's attestation is a signed message of the one format.
    "gate.attestation": {"release.signing"},
}


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module, e.g. lightning_dagster.gate.consistency
    line: int
    name: str  # the imported module, as precise as the statement names it

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.name}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_imports(source: str, importer: str, *, is_package: bool, modules: set[str]) -> list[Import]:
    """Every import statement of a module, wherever it stands (module level, functions, TYPE_CHECKING
    blocks); relative imports resolved, and `from package import module` read as that module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(importer, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = importer.split(".")[: len(importer.split(".")) - (node.level - int(is_package))]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append(Import(importer, node.lineno, submodule if submodule in modules else base))
    return found


@functools.cache
def package_imports() -> tuple[Import, ...]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return tuple(
        imp
        for p in paths
        for imp in read_imports(
            p.read_text(), module_name(p), is_package=p.name == "__init__.py", modules=modules
        )
    )


def unit(module: str) -> str | None:
    """The package (or top-level module) of the project a module belongs to; None outside it."""
    parts = module.split(".")
    return parts[1] if parts[0] == "lightning_dagster" and len(parts) > 1 else None


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def short(module: str) -> str:
    return module.removeprefix("lightning_dagster.")


def listing(problem: str, items: list[str]) -> str:
    return "\n  ".join([f"{problem}:", *items])


# Imports every module of the given packages (except their CLIs when asked; a top-level module is imported
# alone), then prints which of the watched modules ended up loaded.
PROBE = """
import importlib, pkgutil, sys
skip_cli = sys.argv[1] == "1"
watched = sys.argv[2].split(",")
for name in sys.argv[3:]:
    pkg = importlib.import_module(name)
    for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), name + "."):
        if ".migrations" in info.name or (skip_cli and info.name.endswith(".cli")):
            continue
        importlib.import_module(info.name)
print(",".join(w for w in watched if w in sys.modules))
"""


def loaded_after_import(packages: list[str], watched: list[str], *, skip_cli: bool = False) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if skip_cli else "0", ",".join(watched), *packages],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, f"importing {', '.join(packages)} failed:\n{proc.stderr[-3000:]}"
    return [w for w in proc.stdout.strip().split(",") if w]


def test_the_import_reader_sees_every_kind_of_import_statement():
    source = """
from __future__ import annotations
import dagster as dg, os.path
from typing import TYPE_CHECKING
from lightning_dagster.gate import receipt as R, Check
from . import sibling
from ..store import Store
if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry
def later():
    from lightning_dagster.harnesses.calc import agent
"""
    modules = {
        "lightning_dagster.gate.receipt",
        "lightning_dagster.pipeline.sibling",
        "lightning_dagster.store",
    }
    found = read_imports(source, "lightning_dagster.pipeline.context", is_package=False, modules=modules)
    assert sorted((i.line, i.name) for i in found) == [
        (2, "__future__"),
        (3, "dagster"),
        (3, "os.path"),
        (4, "typing"),
        (5, "lightning_dagster.gate"),
        (5, "lightning_dagster.gate.receipt"),
        (6, "lightning_dagster.pipeline.sibling"),
        (7, "lightning_dagster.store"),
        (9, "lightning_dagster.registry.core"),
        (11, "lightning_dagster.harnesses.calc"),
    ]
    # in a package's __init__, `from . import x` is relative to the package itself
    inside = read_imports("from . import x", "lightning_dagster.gate", is_package=True, modules=set())
    assert [i.name for i in inside] == ["lightning_dagster.gate"]


def test_only_the_dagster_wiring_imports_dagster():
    offending = [
        str(imp)
        for imp in package_imports()
        if imp.name.split(".")[0] == "dagster" or imp.name.startswith("dagster_")
        if not within(imp.importer, DAGSTER_WIRING)
    ]
    assert not offending, listing("only orchestration/ and demo/ may import Dagster", offending)
    # the walk does see the wiring's imports: without this, an empty list above would prove nothing
    assert any(imp.name == "dagster" for imp in package_imports() if within(imp.importer, DAGSTER_WIRING))


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


def test_no_core_module_imports_the_examples_or_the_built_in_agents():
    offending = [
        str(imp)
        for imp in package_imports()
        if within(imp.name, EXAMPLE_CODE) and not within(imp.importer, ("lightning_dagster.harnesses",))
    ]
    assert not offending, listing(
        "only lightning_dagster.harnesses, tests, benchmarks and scripts may import these", offending
    )
    # the walk sees the agents' imports where they are allowed
    assert any(within(imp.name, EXAMPLE_CODE) for imp in package_imports())


def package_graph() -> dict[str, dict[str, list[Import]]]:
    """package -> imported package -> the imports that make the arrow (the empty top-level __init__ aside)."""
    graph: dict[str, dict[str, list[Import]]] = {
        name: {} for p in PACKAGE.rglob("*.py") if (name := unit(module_name(p))) is not None
    }
    for imp in package_imports():
        source, target = unit(imp.importer), unit(imp.name)
        if source is not None and target is not None and target != source:
            graph[source].setdefault(target, []).append(imp)
    return graph


def test_the_package_import_graph_is_the_declared_one():
    graph = package_graph()
    assert set(graph) == set(DECLARED) == set(ORDER), "every package and top-level module has its place"
    new = [
        f"{source} -> {target}: {imps[0]}" + (f" (and {len(imps) - 1} more)" if len(imps) > 1 else "")
        for source, edges in sorted(graph.items())
        for target, imps in sorted(edges.items())
        if target not in DECLARED[source]
    ]
    gone = [
        f"{source} -> {target}: declared, but no module of {source} imports {target}"
        for source, targets in sorted(DECLARED.items())
        for target in sorted(targets - set(graph[source]))
    ]
    assert not new, listing(
        "new arrows between packages: declare them in DECLARED and docs/ARCHITECTURE.md", new
    )
    assert not gone, listing(
        "arrows no longer there: remove them from DECLARED and docs/ARCHITECTURE.md", gone
    )


def test_every_import_against_the_layering_is_declared_import_by_import():
    rank = {name: i for i, name in enumerate(ORDER)}
    upward: dict[str, set[str]] = {}
    where: dict[tuple[str, str], Import] = {}
    for imp in package_imports():
        source, target = unit(imp.importer), unit(imp.name)
        if source and target and rank[target] > rank[source]:
            upward.setdefault(short(imp.importer), set()).add(short(imp.name))
            where.setdefault((short(imp.importer), short(imp.name)), imp)
    new = [
        str(where[(m, name)])
        for m, names in sorted(upward.items())
        for name in sorted(names - UPWARD.get(m, set()))
    ]
    gone = [
        f"{m} -> {name}"
        for m, names in sorted(UPWARD.items())
        for name in sorted(names - upward.get(m, set()))
    ]
    assert not new, listing("imports against the layering (each closes a cycle): declare them in UPWARD", new)
    assert not gone, listing("declared in UPWARD but no longer imported: remove them", gone)


def test_the_gate_loads_of_the_release_only_its_pure_signing_and_approvals():
    # The one arrow gate -> release at import time: check 7's verification, which must not drag in the
    # registry (MLflow), the store or torch through the release's other modules.
    release = sorted(f"lightning_dagster.release.{p.stem}" for p in (PACKAGE / "release").glob("[!_]*.py"))
    watched = [
        *release,
        "lightning_dagster.registry",
        "lightning_dagster.store",
        "mlflow",
        "torch",
        "sqlalchemy",
    ]
    assert loaded_after_import(["lightning_dagster.gate"], watched, skip_cli=True) == [
        "lightning_dagster.release.approvals",
        "lightning_dagster.release.signing",
    ]


def test_architecture_md_draws_the_declared_graph():
    text = ARCHITECTURE.read_text()
    section = text.split("## The package import graph", 1)[1]
    block = section.split("```", 2)[1]
    drawn: dict[str, set[str]] = {}
    for line in block.splitlines():
        match = re.fullmatch(r"\s*(\S+)\s+->\s+(.*?)\s*", line)
        if match:
            targets = {t.strip().rstrip("*") for t in match[2].split(",")} - {"(nothing)"}
            drawn.setdefault(match[1], set()).update(targets)  # a long line may go on in a second one
    assert drawn == DECLARED, "the graph docs/ARCHITECTURE.md draws is not DECLARED"
    for module in UPWARD:
        assert f"`{module}`" in section, f"docs/ARCHITECTURE.md does not name {module}'s upward imports"


def test_no_module_is_longer_than_a_reader_can_hold():
    sizes = {
        str(path.relative_to(ROOT)): sum(1 for line in path.read_text().splitlines() if line.strip())
        for path in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 50  # the walk found the package
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}
