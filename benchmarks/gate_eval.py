"""Release-gate cost at 10k, 100k and 1M spans (1k, 10k, 100k rollouts; 10 spans and ~1.1 attempts each).

Phases, timed separately in one run (best of three, CPU and wall clock):
  aggregate  `receipt.add_rollout_evidence` from (rollout_id, family) span pairs (what the asset does)
  dump       receipt -> canonical JSON file text
  load       JSON text -> validated `Receipt` (what `gate evaluate` does first)
  evaluate   the seven checks, staleness and the receipt hash

    .venv/bin/python benchmarks/gate_eval.py
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

from lightning_dagster.gate import receipt as R
from lightning_dagster.gate.checks import PROMOTE, evaluate
from lightning_dagster.gate.policy import load_policy
from lightning_dagster.types import Attempt, AttemptState, RetryKind, Rollout, RolloutKind, RolloutStatus

FIXTURE = Path(__file__).resolve().parents[1] / "examples" / "gate" / "candidate-a.json"
FAMILIES = ["llm"] * 6 + ["tool"] * 3 + ["reward"]  # 10 spans per rollout


def world(n_rollouts: int) -> tuple[R.Receipt, list[Rollout], list[Attempt], list[tuple[str, str]]]:
    base = R.load_receipt(FIXTURE)
    plan = base.plan.model_copy(
        update={
            "expected_rollouts": {RolloutKind.train: n_rollouts},
            "retry_budget": R.RetryBudget(expected_sample_retries=n_rollouts // 10, infrastructure_retries=0),
        }
    )
    rollouts = [
        Rollout(rollout_id=f"ro-{i:07d}", kind=RolloutKind.train, status=RolloutStatus.succeeded)
        for i in range(n_rollouts)
    ]
    attempts = []
    for i, r in enumerate(rollouts):
        if i % 10 == 0:  # every tenth rollout had one expected sample retry
            attempts.append(
                Attempt(rollout_id=r.rollout_id, state=AttemptState.failed, reason_code="malformed")
            )
            attempts.append(
                Attempt(
                    rollout_id=r.rollout_id,
                    sequence_id=2,
                    state=AttemptState.succeeded,
                    retry_kind=RetryKind.sample,
                )
            )
        else:
            attempts.append(Attempt(rollout_id=r.rollout_id, state=AttemptState.succeeded, reason_code="ok"))
    spans = [(r.rollout_id, fam) for r in rollouts for fam in FAMILIES]
    return base.model_copy(update={"plan": plan, "rollouts": None}), rollouts, attempts, spans


def timed(fn):
    """(result, wall seconds, CPU seconds of this process): CPU time is the fair figure when other
    processes share the two cores."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def measure(n_rollouts: int) -> dict[str, float]:
    base, rollouts, attempts, spans = world(n_rollouts)
    policy = load_policy()
    # The inputs stand for objects a long-lived asset process already holds; freezing them keeps the
    # collector from rescanning 1M setup tuples during the timed phases (which would charge setup to them).
    gc.collect()
    gc.freeze()
    receipt, *agg = timed(lambda: R.add_rollout_evidence(base, rollouts, attempts, spans))
    text, *dump = timed(lambda: json.dumps(receipt.to_json_dict()))
    loaded, *load = timed(lambda: R.parse_receipt(json.loads(text)))
    ev, *evl = timed(lambda: evaluate(loaded, policy))
    gc.unfreeze()
    assert ev.verdict == PROMOTE, ev.hold_reasons  # the work was real: every check ran and passed
    assert ev.checks[1].figures["spans"] == len(spans)
    row = {"spans": len(spans), "rollouts": n_rollouts, "attempts": len(attempts), "mb": len(text) / 1e6}
    for k, name in enumerate(("wall", "cpu")):
        row[f"aggregate_{name}"] = agg[k]
        row[f"dump_{name}"] = dump[k]
        row[f"load_{name}"] = load[k]
        row[f"evaluate_{name}"] = evl[k]
        row[f"load+evaluate_{name}"] = load[k] + evl[k]
        row[f"total_{name}"] = agg[k] + dump[k] + load[k] + evl[k]
    return row


PHASES = ["aggregate", "dump", "load", "evaluate", "load+evaluate", "total"]


def main() -> None:
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    # best of three per figure: the machine is shared, and the minimum is the least disturbed run
    rows = []
    for n in (1_000, 10_000, 100_000):
        runs = [measure(n) for _ in range(3)]
        rows.append({k: min(r[k] for r in runs) for k in runs[0]})
    for clock in ("cpu", "wall"):
        print(f"\n{clock} seconds")
        print(f"{'spans':>9} {'rollouts':>8} {'MB':>5} " + " ".join(f"{p:>13}" for p in PHASES))
        for r in rows:
            cells = " ".join(f"{r[f'{p}_{clock}']:>12.3f}s" for p in PHASES)
            print(f"{r['spans']:>9} {r['rollouts']:>8} {r['mb']:>5.1f} {cells}")
        for a, b in zip(rows, rows[1:], strict=False):
            ratios = " ".join(f"{b[f'{p}_{clock}'] / a[f'{p}_{clock}']:>12.1f}x" for p in PHASES)
            print(f"{'x' + str(b['spans'] // a['spans']):>9} {'growth':>8} {'':>5} {ratios}")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
