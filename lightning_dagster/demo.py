"""`lightning-dagster demo`: the whole pipeline once on the embedded default, through real Dagster runs.

Dagster's default local instance (SQLite, under `$DAGSTER_HOME`, default `<home>/dagster_home`), the SQLite
store, a SQLite MLflow tracking store and the embedded engine: bootstrap the first parent as
`approved-default`, cut a snapshot, plan, approve the canary step, materialize the rest of the graph, print
the receipt's verdict and the commands that open the Dagster and MLflow UIs on the same state. The graph
runs the project given with `--project PATH` (`LD_PROJECT`), else the built-in example `examples/calc`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from lightning_dagster.project.cli import add_project_option, exits_2_on_project_error

# The demo prints its own summary; Dagster's per-event console log would drown it.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
# Tiny settings: a smoke run of the whole graph, not a learning one (`--quick`, and the Dagster tests).
QUICK_TRAINING: dict[str, int] = dict(
    steps=2,
    tasks_per_step=4,
    group_size=4,
    holdout_tasks=8,
    protected_tasks=4,
    canary_tasks=2,
    warm_start_max_steps=4,
    warm_start_probe_tasks=8,
    warm_start_demos=64,
)
DEMO_ACTORS = {"release-owner": "demo-release-owner", "default-approver": "demo-default-approver"}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the demo's setting)")
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run, not a learning one")
    add_project_option(parser)
    parser.set_defaults(handler=run)


def use_project(path: Path) -> str:
    """Check the project and its tasks (a `ProjectError` before anything runs), point the pipeline at it
    (`LD_PROJECT`, which the printed UI command carries too) and return its one-line summary."""
    from lightning_dagster.project import load_project, load_tasks

    project = load_project(path)
    tasks = load_tasks(project)
    os.environ["LD_PROJECT"] = str(project.file)
    rows = ", ".join(f"{split} {len(items)}" for split, items in tasks.splits.items())
    return f"project: {project.name} ({project.harness.kind} harness; {tasks.file}: {rows})"


def prepare_environment() -> dict[str, str]:
    """Point Dagster at a local instance in the demo home and give the demo its approvers: each demo actor's
    Ed25519 key pair in `<home>/approver-keys` and a roles file naming their public keys, which the code
    location pins into the demo's store on first use. Both sit outside the learner's write surface
    (models, MLflow artifacts)."""
    from lightning_dagster import config

    home = config.home()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster_home"))
    dagster_home = Path(os.environ["DAGSTER_HOME"])
    dagster_home.mkdir(parents=True, exist_ok=True)
    if not (dagster_home / "dagster.yaml").exists():
        # Dagster's default local SQLite storage; only telemetry (a network call) is turned off.
        (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    os.environ["LD_ROLES_FILE"] = str(write_approvers(home / "approvers.yaml", DEMO_ACTORS))
    project = {"LD_PROJECT": os.environ["LD_PROJECT"]} if os.environ.get("LD_PROJECT") else {}
    return {
        "LIGHTNING_DAGSTER_HOME": str(home),
        "DAGSTER_HOME": os.environ["DAGSTER_HOME"],
        "LD_ROLES_FILE": os.environ["LD_ROLES_FILE"],
        **project,
    }


def approver_keys() -> Path:
    """Where the demo (and its tests) keep approvers' private keys: the home, outside models/ and mlartifacts/."""
    from lightning_dagster import config

    return config.home() / "approver-keys"


def write_approvers(path: Path, actors: dict[str, str]) -> Path:
    """A roles file for `actors` (role -> actor), each with a key pair in `approver_keys()`, made once."""
    from lightning_dagster.registry.signing import generate_keypair

    keys = approver_keys()
    entries = []
    for role, actor in actors.items():
        if not (keys / f"{actor}.key").exists():
            generate_keypair(actor, keys)
        public = (keys / f"{actor}.pub").read_text().strip()
        entries.append(f"  {actor}:\n    roles: [{role}]\n    key: {public}\n")
    path.write_text("# Who may approve what in the demo, and with which key.\nactors:\n" + "".join(entries))
    return path


def approval_config(pipeline: Any, key: str, approver: tuple[str, str]) -> dict[str, Any]:
    """The `approve` job's op config: `approver` = (actor, role) signs the snapshot's receipt as it stands
    with the actor's key from `approver_keys()`."""
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.registry.signing import sign_approval

    actor, role = approver
    receipt = ctx.head_receipt(pipeline.get_store(), key)
    approval = sign_approval(receipt, actor=actor, role=role, key=approver_keys() / f"{actor}.key")
    return {"snapshot_key": key, **approval.model_dump(mode="json")}


def demo_training(steps: int | None, quick: bool):
    from lightning_dagster.resources import TrainingResource

    if quick:
        return TrainingResource(**{**QUICK_TRAINING, "steps": steps or QUICK_TRAINING["steps"]})
    # The code location's defaults: the same evaluator fingerprint in the demo and in the UI.
    return TrainingResource(**({"steps": steps} if steps else {}))


def run_snapshot(defs: Any, instance: Any, key: str, *, approver: tuple[str, str] | None) -> list[Any]:
    """Plan, optionally approve the canary step (signed with the approver's key), then materialize the rest of the snapshot's graph, each as a
    run of the `continual_learning` / `approve` jobs on `instance`. Returns the run results."""
    job = defs.resolve_job_def("continual_learning")
    planned = ["tasks", "update_plan"]
    results = [_run(job, instance, key, planned)]
    if approver is not None:
        config = approval_config(defs.resources["pipeline"], key, approver)
        results.append(
            defs.resolve_job_def("approve").execute_in_process(
                instance=instance, run_config={**QUIET, "ops": {"approve_receipt": {"config": config}}}
            )
        )
    rest = [a.key.to_user_string() for a in _assets() if a.key.to_user_string() not in planned]
    results.append(_run(job, instance, key, rest))
    if not any(m.asset_key.to_user_string() == "release_receipt" for m in _materializations(results[-1])):
        # A blocking check stopped the graph: the receipt alone still judges all seven checks itself and
        # names every one that did not pass (selecting it alone is no bypass).
        results.append(_run(job, instance, key, ["release_receipt"]))
    return results


def _materializations(result: Any) -> list[Any]:
    return [e.materialization for e in result.get_asset_materialization_events()]


def _assets() -> list[Any]:
    from lightning_dagster.assets import snapshot_assets

    return snapshot_assets


def _run(job: Any, instance: Any, key: str, selection: list[str]) -> Any:
    import dagster as dg

    return job.execute_in_process(
        instance=instance,
        partition_key=key,
        asset_selection=[dg.AssetKey(name) for name in selection],
        raise_on_error=False,
        run_config=QUIET,
    )


@exits_2_on_project_error
def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from lightning_dagster.project.examples import example_file

    project = use_project(args.project if args.project is not None else example_file("calc"))
    env = prepare_environment()
    import dagster as dg

    from lightning_dagster import config
    from lightning_dagster.definitions import build_definitions
    from lightning_dagster.partitions import snapshots
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.pipeline.bootstrap import bootstrap_parent
    from lightning_dagster.pipeline.triggers import Watermark, cut_snapshot, new_evidence

    training = demo_training(args.steps, args.quick)
    defs = build_definitions(deferred=False, training=training)
    pipeline = defs.resources["pipeline"]
    print(f"lightning-dagster demo: home {env['LIGHTNING_DAGSTER_HOME']}", flush=True)
    print(project, flush=True)
    boot = bootstrap_parent(pipeline).metadata
    print(f"parent: approved-default = version {boot['approved_default']} {_fmt(boot)}", flush=True)
    instance = dg.DagsterInstance.get()
    key = cut_snapshot(pipeline, new_evidence(pipeline, Watermark(), force=True), dt.datetime.now(dt.UTC))
    instance.add_dynamic_partitions(snapshots.name, [key])
    print(f"snapshot: {key}", flush=True)
    results = run_snapshot(defs, instance, key, approver=(DEMO_ACTORS["release-owner"], "release-owner"))
    for r in results:
        failed = [e.step_key for e in r.all_events if e.is_step_failure]
        print(
            f"run {r.run_id[:8]} ({r.job_def.name}): {'success' if r.success else 'stopped at ' + ', '.join(failed)}"
        )
    receipt = ctx.find_receipt(pipeline.get_store(), key)
    verdict = receipt.gate.verdict if receipt is not None and receipt.gate is not None else None
    if verdict is None:
        print(
            "verdict: none -- a blocking check stopped the graph before release_receipt (see the failed check)"
        )
    else:
        print(f"verdict: {verdict}  (receipt {receipt.receipt_id})")
        failed = sorted(
            {*receipt.gate.failed_checks, *receipt.gate.unavailable_checks, *receipt.gate.stale_checks}
        )
        if failed:
            print(f"  checks not passed: {', '.join(f'{c} {c.name}' for c in failed)}")
    print(f"seconds: {time.perf_counter() - started:.0f}")
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    print("\nwhere to look next:")
    print(f"  Dagster UI:  {exports} dagster dev -m lightning_dagster.definitions -h 127.0.0.1 -p 3000")
    print(
        f"  MLflow UI:   mlflow ui --backend-store-uri {shlex.quote(config.mlflow_tracking_uri())} "
        f"--default-artifact-root {shlex.quote(str(config.mlflow_artifact_root()))} -h 127.0.0.1 -p 5000"
    )
    if verdict == "PROMOTE TO BOUNDED CANARY":
        promoter = DEMO_ACTORS["default-approver"]
        print(
            f"  promote:     {exports} lightning-dagster registry promote {receipt.receipt_id} "
            f"--actor {promoter} --key {shlex.quote(str(approver_keys() / f'{promoter}.key'))}"
        )
    return 0 if verdict is not None else 1


def _fmt(meta: dict) -> str:
    if not meta.get("bootstrapped"):
        return "(existing)"
    if not meta["warm_start_steps"]:
        return f"(base model {meta['base_model']}, no warm start)"
    return f"(warm start: {meta['warm_start_steps']} steps, probe success {meta['probe_success']:.2f}, {meta['seconds']} s)"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="lightning-dagster demo")
    register(parser)
    sys.exit(run(parser.parse_args()))
