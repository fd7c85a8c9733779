"""Share of one continual-learning cycle spent in Dagster orchestration rather than in the core work.

One run, two snapshots side by side on the same bootstrapped home:
  A. through Dagster: the `continual_learning` job (plan, then the rest) and the `approve` job on a local
     SQLite instance, exactly as `lightning-dagster demo` does; every stage function is timed inside.
  B. the same stage functions called directly in the same order, no Dagster.
Orchestration = A's wall time minus the time inside the stage functions (and the checks' gate calls).

    .venv/bin/python benchmarks/orchestration_share.py            # tiny settings (CI-sized)
    .venv/bin/python benchmarks/orchestration_share.py --demo     # the demo's settings
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--demo", action="store_true", help="the demo's training settings instead of tiny ones"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ld-orch-"))
    os.environ["LIGHTNING_DAGSTER_HOME"] = str(root / "home")
    os.environ["DAGSTER_HOME"] = str(root / "dagster_home")
    Path(os.environ["DAGSTER_HOME"]).mkdir(parents=True)

    import dagster as dg

    from lightning_dagster.demo import DEMO_ACTORS, demo_training, prepare_environment, run_snapshot
    from lightning_dagster.orchestration.assets.gate_checks import JUDGED_ASSET
    from lightning_dagster.orchestration.definitions import build_definitions
    from lightning_dagster.orchestration.partitions import snapshots
    from lightning_dagster.orchestration.resources import GateResource
    from lightning_dagster.pipeline.bootstrap import bootstrap_parent
    from lightning_dagster.pipeline.snapshots import freeze_tasks
    from lightning_dagster.pipeline.stages import ASSET_STAGES, release
    from lightning_dagster.pipeline.triggers import Cut, Watermark, cut_snapshot, new_evidence

    prepare_environment()
    # Tiny settings cannot show the default policy's +0.02 margin over 100 held-out tasks; the test policy
    # keeps every other threshold, so both cycles run the whole graph.
    tiny_policy = Path(__file__).resolve().parents[1] / "tests" / "dagster" / "policy-tiny.yaml"
    gate = GateResource(
        policy_path="" if args.demo else str(tiny_policy),
        roles_path=os.environ.get("LD_ROLES_FILE", ""),
        pipeline_key_path=os.environ.get("LD_PIPELINE_KEY", ""),  # signs the bootstrap move
        roles_admin_key=os.environ.get("LD_ROLES_ADMIN_KEY", ""),
    )
    defs = build_definitions(deferred=False, training=demo_training(not args.demo), gate=gate)
    p = defs.resources["pipeline"]
    bootstrap_parent(p)
    approver = (DEMO_ACTORS["release-owner"], "release-owner")

    core = {"seconds": 0.0}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                core["seconds"] += time.perf_counter() - t

        return wrapper

    # The assets, checks and jobs look the functions up on the module at call time, so wrapping them here
    # times exactly the core work each Dagster step does.
    for module, name in [(s.module, s.name) for s in ASSET_STAGES] + [
        (release, "judge"),
        (release, "approve"),
    ]:
        setattr(module, name, timed(getattr(module, name)))

    def cut(minute: int) -> Cut:
        at = dt.datetime(2026, 11, 30, 12, minute, tzinfo=dt.UTC)
        return cut_snapshot(p, new_evidence(p, Watermark(), force=True), at)

    instance = dg.DagsterInstance.get()
    cut_a = cut(0)
    key_a = cut_a.key
    instance.add_dynamic_partitions(snapshots.name, [key_a])
    t = time.perf_counter()
    results = run_snapshot(defs, instance, key_a, approver=approver, cut=cut_a.config)
    dagster_wall = time.perf_counter() - t
    dagster_core = core["seconds"]
    complete = all(r.success for r in results)

    cut_b = cut(1)
    key_b = cut_b.key
    freeze_tasks(p, key_b, cut_b.config)  # what the `tasks` run does with the cut's config
    core["seconds"] = 0.0
    t = time.perf_counter()
    for stage in ASSET_STAGES:
        getattr(stage.module, stage.name)(p, key_b)
        if stage.name == "update_plan":
            release.approve(p, key_b, *approver)
        for check, asset in JUDGED_ASSET.items():  # each blocking check after the asset it judges
            if asset.key.to_user_string() == stage.name:
                release.judge(p, key_b, check)
    direct_wall = time.perf_counter() - t

    orchestration = dagster_wall - dagster_core
    print(f"settings: {'demo' if args.demo else 'tiny'}; snapshots {key_a} (Dagster) and {key_b} (direct)")
    print(f"A  Dagster cycle:      {dagster_wall:7.1f} s wall, {dagster_core:7.1f} s in core stage functions")
    print(f"B  direct cycle:       {direct_wall:7.1f} s wall")
    print(
        f"orchestration share:   {orchestration / dagster_wall:7.1%} of the Dagster cycle ({orchestration:.1f} s)"
    )
    print(f"Dagster / direct wall: {dagster_wall / direct_wall:7.2f}x")
    print(f"Dagster cycle complete (no blocking check failed): {complete}")


if __name__ == "__main__":
    main()
