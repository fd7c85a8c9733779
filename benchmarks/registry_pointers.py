"""Resolving `approved-default` and reading its history as the registry grows to 10, 100 and 1,000 versions.

Each version is a registered MLflow model version (tagged with a weights hash) and one compare-and-set move
of `approved-default` in the store, so both the version count and the pointer history grow. Measured side
by side in one run, p50 over `--reps` calls:
- `resolve`: `Registry.resolve("approved-default", download=False)` (reconcile with MLflow, the store's
  pointer and history, the version's tags, the weights-hash check);
- `history`: `Registry.history()` (the store's append-only history, all moves);
- `mlflow alias`: MLflow's own `get_model_version_by_alias` (no history, no compare-and-set), the floor.

    .venv/bin/python benchmarks/registry_pointers.py              # SQLite tracking store and store
    .venv/bin/python benchmarks/registry_pointers.py --postgres   # mlflow server + PostgreSQL for both
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def p50_ms(fn, reps: int) -> float:
    fn()  # warm: connections, caches
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def grow(registry, run, target: int, keys) -> None:
    """Register versions until there are `target`, moving approved-default to each (one history entry): the
    first by the pipeline's signed bootstrap, the others by the bench approver's signed promotions."""
    from lightning_dagster.registry.core import APPROVED
    from lightning_dagster.release import chain
    from lightning_dagster.release.signing import load_private_key

    client, name = registry.client, registry.model_name
    while (current := registry.store.current_pointer(registry.pointer_name())) is None or int(
        current
    ) < target:
        seq = registry.store.pointer_state(registry.pointer_name())[1]
        actor, role, kind = ("pipeline", "pipeline", chain.BOOTSTRAP) if current is None else (
            "bench", "default-approver", chain.PROMOTION
        )  # fmt: skip
        weights = f"{int(current or 0) + 1:064x}"
        mv = client.create_model_version(
            name,
            f"{run.info.artifact_uri}/checkpoint",
            run_id=run.info.run_id,
            tags={"weights_hash": weights},
        )
        note = chain.move_note(weights, None, kind=kind, role=role, at=time.time())
        key = load_private_key(keys[actor].private_path)
        note["signature"] = chain.sign_move(
            key, registry.pointer_name(), seq + 1, current, str(mv.version), actor, None, note
        )
        registry.store.move_pointer(
            registry.pointer_name(),
            expected=current,
            to=str(mv.version),
            actor=actor,
            note=json.dumps(note),
        )
    registry.reconcile()
    assert registry.resolve(APPROVED, download=False).version == str(target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--postgres", action="store_true", help="mlflow server and store on PostgreSQL")
    args = parser.parse_args()

    from lightning_dagster.registry import APPROVED, Registry
    from lightning_dagster.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="ld-bench-registry-"))
    os.environ.setdefault("LIGHTNING_DAGSTER_HOME", str(tmp / "home"))
    cleanup = []
    if args.postgres:
        from tests.registry.mlflow_server import MlflowServer
        from tests.support.postgres import PostgresServer

        pg = PostgresServer().start()
        cleanup.append(pg.stop)
        server = MlflowServer(
            pg.url(pg.create_database("mlflow")), tmp / "artifacts", tmp / "server.log"
        ).start()
        cleanup.insert(0, server.stop)
        tracking_uri, store_url, backend = (
            server.url,
            pg.url(pg.create_database("store")),
            "mlflow server + PostgreSQL",
        )
    else:
        tracking_uri, store_url, backend = (
            f"sqlite:///{tmp / 'mlflow.db'}",
            f"sqlite:///{tmp / 'store.db'}",
            "SQLite",
        )
    try:
        from lightning_dagster.release.signing import generate_keypair
        from lightning_dagster.settings import GateSettings

        # the deployment's anchors: the pipeline's key (the bootstrap) and a roles file naming the approver
        keys = {a: generate_keypair(a, tmp / "keys") for a in ("pipeline", "bench")}
        (tmp / "roles.yaml").write_text("actors:\n" + keys["bench"].roles_entry(["default-approver"]))
        gate = GateSettings(
            roles_path=str(tmp / "roles.yaml"), pipeline_key_path=str(keys["pipeline"].private_path)
        )
        registry = Registry(tracking_uri, Store(store_url), "bench-policy", tmp / "artifacts", gate=gate)
        registry.reconcile()
        # Versions point into one run's artifact directory: a server refuses sources outside a run.
        run = registry.client.create_run(registry.experiment_id, run_name="bench-versions")
        print(f"backend: {backend}; p50 of {args.reps} calls each, milliseconds")
        print(
            f"{'versions':>8} {'resolve':>9} {'history':>9} {'mlflow alias':>13} {'resolve/alias':>14} {'grow s':>7}"
        )
        rows = []
        for n in [int(x) for x in args.sizes.split(",")]:
            start = time.perf_counter()
            grow(registry, run, n, keys)
            grown = time.perf_counter() - start
            resolve = p50_ms(lambda: registry.resolve(APPROVED, download=False), args.reps)
            history = p50_ms(
                lambda n=n: len(registry.history()) == n or sys.exit("history length"), args.reps
            )
            alias = p50_ms(
                lambda: registry.client.get_model_version_by_alias("bench-policy", APPROVED), args.reps
            )
            rows.append((n, resolve, history, alias))
            print(
                f"{n:>8} {resolve:>9.2f} {history:>9.2f} {alias:>13.2f} {resolve / alias:>13.1f}x {grown:>7.1f}"
            )
        first = rows[0]
        for n, resolve, history, alias in rows[1:]:
            print(
                f"growth {first[0]} -> {n} versions: resolve x{resolve / first[1]:.2f}, history x{history / first[2]:.2f}, "
                f"mlflow alias x{alias / first[3]:.2f}"
            )
    finally:
        for fn in cleanup:
            fn()
    return 0


if __name__ == "__main__":
    sys.exit(main())
