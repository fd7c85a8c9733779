"""Cycle 1 of the release graph for several seeds and two training recipes, from ONE warm-started parent.

Each run is what `lightning-dagster demo` does up to its first verdict: bootstrap the parent as version 1 of
`approved-default`, cut a snapshot, run the whole asset graph through `release_receipt` in Dagster (the
canary step signed by the demo's release owner), and read the judged receipt. Every run starts from the same
given parent (`--parent`, no warm start: the project is a copy of the built-in calc example whose
`model.path` is a copy of that parent), and the runs differ only in the recipe and the seed:

- **recipe** `demo`: the code location's defaults, `TrainingResource()` as it is when the script runs;
  `previous`: the recipe before KL and checkpoint selection (16 steps x 16 tasks x group 16, `kl_coef` 0, no
  validation tasks). `--quick` puts `demo.settings.QUICK_TRAINING` on top of each (a smoke test only).
- **seed** fixes the snapshot key `snap-20260101T0000Z-<seed, 8 digits>`, added by hand as a partition: the
  graph freezes its tasks from the key's own hash (`snapshots.freeze_tasks`), so a seed picks the train
  tasks and the RL sampling seeds, while the held-out and protected sets are the same for every run.

As in the demo's cycle 1, the project runs from a working copy (`demo.setup.WorkingCopy`) whose late train
tasks are withheld. Each run is its own process with its own home (`LIGHTNING_DAGSTER_HOME`, Dagster
instance, store and MLflow store under `--work`/<recipe>-seed<seed>, kept, with the run's log in `run.log`):
the script re-invokes itself with `--one RECIPE SEED --home H` and reads the `RESULT {json}` line it prints.

Prints a line per run, then a markdown table (for benchmarks/README.md): recipe, seed, snapshot key,
held-out sampled success of parent and candidate (n-weighted over families, as check 4 computes it), margin,
protected regressions (n of m), the status of each of the seven checks, the verdict, the chosen checkpoint
step of the steps run, and the seconds of the cycle (bootstrap excluded); and per recipe how many seeds
ended PROMOTE TO BOUNDED CANARY with margin >= +0.10 and no protected regression. Writes all figures as JSON.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/release_seeds.py --parent DIR [--recipes demo,previous]
     [--seeds 0,1,2] [--work DIR] [--out test-artifacts/release_seeds.json] [--quick] [--verbose]
(DIR: a warm-started parent model folder, e.g. `<home>/models/parent-0` of a `lightning-dagster demo` run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The settings each recipe changes from `TrainingResource()`; `demo` changes none.
RECIPES: dict[str, dict[str, Any]] = {
    "demo": {},
    "previous": dict(
        steps=16, tasks_per_step=16, group_size=16, kl_coef=0.0, validation_tasks=0, validation_patience=0
    ),
}
PROMOTE = "PROMOTE TO BOUNDED CANARY"
MIN_MARGIN = 0.10
# Variables that would point a run at state outside its own home; the child sets or drops each.
FOREIGN_STATE = (
    "LIGHTNING_DAGSTER_HOME",
    "DAGSTER_HOME",
    "LD_STORE_URL",
    "MLFLOW_TRACKING_URI",
    "LD_MLFLOW_ARTIFACTS",
    "LD_ROLES_FILE",
    "LD_PROJECT",
)
STATUS_MARK = {"passed": "pass", "failed": "FAIL", "unavailable": "n/a", "stale": "stale", None: "-"}


def snapshot_key_for(seed: int) -> str:
    return f"snap-20260101T0000Z-{seed:08d}"


def recipe_training(recipe: str, quick: bool) -> Any:
    from lightning_dagster.demo.quick import QUICK_TRAINING
    from lightning_dagster.orchestration.resources import TrainingResource

    return TrainingResource(**{**RECIPES[recipe], **(QUICK_TRAINING if quick else {})})


# ---------------------------------------------------------------- one run, in its own process


def write_project(home: Path, parent: Path) -> Path:
    """The calc example with `model.path` = a copy of `parent` (in the home, so nothing a run does can touch
    the shared one) and no warm start: `bootstrap_parent` registers it as it is."""
    import yaml

    from lightning_dagster.project.config import PROJECT_FILE
    from lightning_dagster.project.examples import example_file

    example = example_file("calc")
    data = yaml.safe_load(example.read_text())
    folder = home / "project"
    folder.mkdir(parents=True)
    tasks = Path(data["tasks"]["path"])
    assert not tasks.is_absolute(), tasks
    (folder / tasks).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(example.parent / tasks, folder / tasks)
    model = shutil.copytree(parent, home / "parent")
    data["model"] = {"path": str(model)}  # neither warm_start nor upstream
    header = f"# benchmarks/release_seeds.py: {example} with the parent {parent}, no warm start\n"
    file = folder / PROJECT_FILE
    file.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return file


def checkpoint_figures(store: Any, key: str, receipt: Any) -> tuple[int | None, int | None]:
    """(chosen step, steps run): what candidate_resource recorded of its checkpoint selection."""
    from lightning_dagster.pipeline import context as ctx

    try:
        selection = ctx.load_stage(store, key, "candidate_resource").get("selection") or {}
    except ctx.StageMissing:
        selection = {}
    if selection:
        return selection.get("chosen_step"), selection.get("steps_run")
    run = getattr(receipt.candidate, "training", None) if receipt and receipt.candidate else None
    return (run.chosen_step, run.steps_run) if run is not None else (None, None)


def receipt_figures(store: Any, key: str) -> dict[str, Any]:
    """The judged receipt's figures: held-out success of both sides, margin, protected regressions, the
    verdict and every check's status."""
    from lightning_dagster.gate.check_ids import Check
    from lightning_dagster.pipeline import context as ctx

    receipt = ctx.find_receipt(store, key)
    out: dict[str, Any] = {"receipt_id": None, "verdict": None, "checks": {c.name: None for c in Check}}
    if receipt is None:
        return out
    out["receipt_id"] = receipt.receipt_id
    out["parent_weights_hash"] = receipt.plan.parent.weights_hash
    out["candidate_version"] = receipt.candidate.model_version if receipt.candidate else None
    if receipt.holdout is not None:
        scored = [
            f for f in receipt.holdout.families if f.candidate_mean is not None and f.parent_mean is not None
        ]
        n = sum(f.n for f in scored)
        if n:
            parent = sum(f.n * f.parent_mean for f in scored) / n
            candidate = sum(f.n * f.candidate_mean for f in scored) / n
            out.update(
                heldout_n=n, parent_success=parent, candidate_success=candidate, margin=candidate - parent
            )
    if receipt.protected is not None:
        out["protected_regressions"] = sum(len(f.regressed) for f in receipt.protected.families)
        out["protected_cases"] = sum(f.n for f in receipt.protected.families)
        out["protected_regressed_cases"] = [c for f in receipt.protected.families for c in f.regressed]
    gate = receipt.gate
    if gate is not None:
        out["verdict"] = gate.verdict
        for check in Check:
            status = "passed"
            for name, failed in (("failed", gate.failed_checks), ("unavailable", gate.unavailable_checks),
                                 ("stale", gate.stale_checks)):  # fmt: skip
                if check in failed:
                    status = name
                    break
            out["checks"][check.name] = status
    out["chosen_step"], out["steps_run"] = checkpoint_figures(store, key, receipt)
    return out


def run_one(recipe: str, seed: int, home: Path, parent: Path, quick: bool) -> dict[str, Any]:
    """Bootstrap the parent and run cycle 1 for the seed's snapshot, as `run_demo` and `run_cycles` do."""
    home = home.resolve()
    for name in FOREIGN_STATE:
        os.environ.pop(name, None)
    # set before anything reads them: the home, the store, MLflow's and Dagster's instance follow from these
    os.environ["LIGHTNING_DAGSTER_HOME"] = str(home)
    os.environ["DAGSTER_HOME"] = str(home / "dagster_home")

    import dagster as dg

    from lightning_dagster import paths
    from lightning_dagster.demo.cycles import Demo, bootstrap, run_cycle
    from lightning_dagster.demo.location import Location
    from lightning_dagster.demo.progress import StageLines
    from lightning_dagster.demo.setup import DEMO_ACTORS, WorkingCopy, prepare_environment, use_project
    from lightning_dagster.orchestration.definitions import build_definitions
    from lightning_dagster.orchestration.partitions import snapshots
    from lightning_dagster.pipeline.snapshots import validate_snapshot_key

    started = time.perf_counter()
    training = recipe_training(recipe, quick)
    lines = StageLines(lambda text: print(text, flush=True))
    copy = WorkingCopy(write_project(paths.home(), parent), paths.home())
    print(use_project(copy.file), flush=True)
    env = prepare_environment(dict(DEMO_ACTORS))
    defs = build_definitions(deferred=False, training=training)
    key = validate_snapshot_key(snapshot_key_for(seed))
    with dg.DagsterInstance.get() as instance, Location(instance) as location:
        demo = Demo(defs=defs, instance=instance, copy=copy, lines=lines, env=env, actors=dict(DEMO_ACTORS))
        demo.location = location
        try:
            parent_version = bootstrap(demo)
            instance.add_dynamic_partitions(snapshots.name, [key])
            lines.line("snapshot", f"{key} added by hand for seed {seed}")
            # queued as the sensor's cut would be: `run_cycle` runs the snapshot's queued run
            demo.queued[key] = location.submit("continual_learning", {}, partition=key).run_id
            cycle_started = time.perf_counter()
            cycle = run_cycle(demo, 1, key)
            cycle_seconds = time.perf_counter() - cycle_started
            lines.out(cycle.line())
            figures = receipt_figures(demo.pipeline.get_store(), key)
        finally:
            demo.pipeline.get_store().engine.dispose()
    return {
        "recipe": recipe,
        "seed": seed,
        "snapshot": key,
        "home": str(home),
        "parent_version": parent_version,
        "training": {name: getattr(training, name) for name in type(training).model_fields},
        **figures,
        "not_passed": cycle.not_passed,
        "never_ran": cycle.never_ran,
        "cycle_seconds": round(cycle_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }


# ---------------------------------------------------------------- the benchmark: one process per run


def launch(recipe: str, seed: int, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`--one` in a child process with a clean environment; its output goes to `<home>/run.log`."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_STATE}
    env.update(
        LIGHTNING_DAGSTER_HOME=str(home), DAGSTER_HOME=str(home / "dagster_home"), PYTHONUNBUFFERED="1"
    )
    command = [sys.executable, str(Path(__file__).resolve()), "--one", recipe, str(seed), "--home", str(home),
               "--parent", str(args.parent), *(["--quick"] if args.quick else [])]  # fmt: skip
    home.mkdir(parents=True)
    result: dict[str, Any] | None = None
    log = home / "run.log"
    with (
        log.open("w") as sink,
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as child,
    ):
        assert child.stdout is not None
        for line in child.stdout:
            sink.write(line)
            sink.flush()
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            elif args.verbose:
                print(f"    {line}", end="", flush=True)
    if result is None:
        tail = "".join(log.read_text().splitlines(keepends=True)[-5:]).strip()
        return {"recipe": recipe, "seed": seed, "snapshot": snapshot_key_for(seed), "home": str(home),
                "error": f"exit {child.returncode}, no result (log {log}): {tail}"}  # fmt: skip
    return result


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def progress(i: int, total: int, row: dict[str, Any]) -> str:
    head = f"[{i}/{total}] {row['recipe']} seed {row['seed']} ({row['snapshot']})"
    if "error" in row:
        return f"{head}: {row['error']}"
    return (
        f"{head}: {row['verdict']}, held-out {fmt(row.get('parent_success'))} -> "
        f"{fmt(row.get('candidate_success'))} (margin {fmt(row.get('margin'), '+.3f')}), protected regressions "
        f"{row.get('protected_regressions', '-')}/{row.get('protected_cases', '-')}, checkpoint "
        f"{row.get('chosen_step') or '-'}/{row.get('steps_run') or '-'}, {row['cycle_seconds']:.0f} s "
        f"(home {row['home']})"
    )


def earned(row: dict[str, Any]) -> bool:
    """PROMOTE TO BOUNDED CANARY with margin >= +0.10 and zero protected regressions."""
    margin = row.get("margin")
    return (
        row.get("verdict") == PROMOTE
        and margin is not None
        and round(margin, 9) >= MIN_MARGIN
        and row.get("protected_regressions") == 0
    )


def table(rows: list[dict[str, Any]]) -> list[str]:
    from lightning_dagster.gate.check_ids import Check

    head = ["recipe", "seed", "snapshot", "parent", "candidate", "margin", "protected regr.",
            *(str(c.value) for c in Check), "verdict", "step / run", "s"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        if "error" in row:
            cells = [
                row["recipe"],
                str(row["seed"]),
                row["snapshot"],
                *["-"] * (len(head) - 6),
                "error",
                "-",
                "-",
            ]
        else:
            protected = (
                f"{row['protected_regressions']} of {row['protected_cases']}"
                if row.get("protected_cases") is not None
                else "-"
            )
            verdict = {PROMOTE: "PROMOTE", None: "none"}.get(row["verdict"], row["verdict"])
            cells = [
                row["recipe"], str(row["seed"]), row["snapshot"], fmt(row.get("parent_success")),
                fmt(row.get("candidate_success")), fmt(row.get("margin"), "+.3f"), protected,
                *(STATUS_MARK[row["checks"][c.name]] for c in Check), verdict,
                f"{row.get('chosen_step') or '-'} / {row.get('steps_run') or '-'}", f"{row['cycle_seconds']:.0f}",
            ]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append("checks: " + ", ".join(f"{c.value} {c.title}" for c in Check))
    out.append(
        "parent/candidate: held-out sampled success; PROMOTE: PROMOTE TO BOUNDED CANARY; step / run: the chosen "
        "checkpoint's step of the RL steps run; s: seconds of the cycle"
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=Path, required=True, help="the warm-started parent model folder")
    parser.add_argument(
        "--recipes", default="demo,previous", help=f"comma-separated, of {', '.join(RECIPES)}"
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated snapshot seeds")
    parser.add_argument(
        "--work", type=Path, help="where each run's home goes (default: a new temp dir, kept)"
    )
    parser.add_argument("--out", type=Path, default=Path("test-artifacts/release_seeds.json"))
    parser.add_argument(
        "--quick", action="store_true", help="QUICK_TRAINING on top of each recipe: a smoke test"
    )
    parser.add_argument("--verbose", action="store_true", help="print each run's stage lines as they happen")
    parser.add_argument("--one", nargs=2, metavar=("RECIPE", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.parent = args.parent.resolve()
    if not (args.parent / "config.json").is_file():
        parser.error(f"--parent {args.parent} is not a model folder (no config.json)")

    if args.one is not None:
        recipe, seed = args.one[0], int(args.one[1])
        if args.home is None:
            parser.error("--one needs --home")
        result = run_one(recipe, seed, args.home, args.parent, args.quick)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; known: {', '.join(RECIPES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    work = (args.work or Path(tempfile.mkdtemp(prefix="ld-release-seeds-"))).resolve()
    taken = [f"{r}-seed{s}" for r in recipes for s in seeds if (work / f"{r}-seed{s}").exists()]
    if taken:
        parser.error(
            f"{work} already holds {', '.join(taken)}: every run needs a fresh home (another --work)"
        )
    print(f"release seeds: parent {args.parent}, recipes {', '.join(recipes)}, seeds {seeds}, work {work}"
          + (" (quick: a smoke test, not a learning run)" if args.quick else ""), flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    total = len(recipes) * len(seeds)
    for recipe in recipes:
        for seed in seeds:
            rows.append(launch(recipe, seed, work / f"{recipe}-seed{seed}", args))
            print(progress(len(rows), total, rows[-1]), flush=True)

    print()
    for line in table(rows):
        print(line)
    print()
    summary = {}
    for recipe in recipes:
        mine = [r for r in rows if r["recipe"] == recipe]
        summary[recipe] = {"seeds": len(mine), "earned": sum(earned(r) for r in mine)}
        print(
            f"{recipe}: {summary[recipe]['earned']} of {len(mine)} seeds ended {PROMOTE} with margin >= "
            f"+{MIN_MARGIN:.2f} and zero protected regressions"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "parent": str(args.parent),
                "quick": args.quick,
                "work": str(work),
                "runs": rows,
                "summary": summary,
            },
            indent=1,
            default=str,
        )
    )
    print(f"wrote {args.out}")
    return 0 if all("error" not in r and r.get("verdict") is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
