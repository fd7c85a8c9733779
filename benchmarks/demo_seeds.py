"""`lightning-dagster demo` (what `make demo` runs after installing) from a fresh home, once per seed, one after
the other: the first parent's probe, both verdicts, whether and when `approved-default` moved, the wall time.

    .venv/bin/python benchmarks/demo_seeds.py --seeds 0 1 2 3 4 [--quick] [--out DIR]

Each run gets a new empty `LIGHTNING_DAGSTER_HOME` (the demo makes its Dagster home inside it) and the
default policy (`--quick`: quick-v1, the smoke run's); its whole output is kept in DIR/seed-N.log. The table
is printed at the end, and as JSON lines in DIR/results.jsonl as each run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARENT = re.compile(r"\] parent: approved-default = version \S+ \((.*)\)")
PROBE = re.compile(r"probe ([\d.]+)")
VERDICT = re.compile(r"^verdict: cycle (\d) \([^)]*\): (.+?)(?: under (\S+)|$)")
NOT_PASSED = re.compile(r"; checks not passed: ([^;]*)")
PROMOTED = re.compile(r"^\[\s*(\d+)s\] promotion: approved-default -> (\S+) by")
POINTER = re.compile(r"^approved-default: (\S+) -> (\S+)$")
CYCLE_LINE = re.compile(r"^\[\s*\d+s\] cycle (\d) ")


def summarize(lines: list[str]) -> dict:
    """What one demo's output says: parent, verdicts, the move and after which cycle."""
    out: dict = {"verdicts": {}, "not_passed": {}, "moved": None, "moved_at_s": None, "after_cycle": None}
    cycle = 0
    for line in lines:
        if m := PARENT.search(line):
            out["parent"] = m.group(1)
            probe = PROBE.search(m.group(1))
            out["probe"] = float(probe.group(1)) if probe else None
        if m := CYCLE_LINE.match(line):
            cycle = int(m.group(1))
        if m := VERDICT.match(line):
            out["verdicts"][m.group(1)] = m.group(2)
            out["policy"] = m.group(3)
            if failed := NOT_PASSED.search(line):
                out["not_passed"][m.group(1)] = failed.group(1)
        if m := PROMOTED.match(line):
            out["moved_at_s"], out["after_cycle"] = int(m.group(1)), cycle
        if m := POINTER.match(line):
            out["moved"] = f"{m.group(1)} -> {m.group(2)}" if m.group(1) != m.group(2) else None
    return out


def run(seed: int, quick: bool, logs: Path) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"ld-demo-seed{seed}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "DAGSTER_", "MLFLOW_"))}
    env["LIGHTNING_DAGSTER_HOME"] = str(home / "home")
    command = [str(ROOT / ".venv" / "bin" / "lightning-dagster"), "demo", "--seed", str(seed)]
    command += ["--quick"] if quick else []
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    (logs / f"seed-{seed}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    return {"seed": seed, "exit": done.returncode, "wall_s": round(wall), "home": str(home),
            **summarize(done.stdout.splitlines())}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="ld-demo-seeds-")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        row = run(seed, args.quick, args.out)
        rows.append(row)
        with (args.out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        f"{'seed':>4}  {'probe':>5}  {'cycle 1':<26}  {'cycle 2':<26}  {'approved-default':<16}  {'wall':>5}"
    )
    for r in rows:
        v = r["verdicts"]
        moved = f"{r['moved']} (c{r['after_cycle']})" if r["moved"] else "stayed"
        probe = f"{r['probe']:.2f}" if r.get("probe") is not None else "-"
        print(f"{r['seed']:>4}  {probe:>5}  {v.get('1', '-'):<26}  {v.get('2', '-'):<26}  {moved:<16}  "
              f"{r['wall_s']:>4}s")  # fmt: skip
    moved = sum(1 for r in rows if r["moved"])
    print(f"approved-default moved in {moved} of {len(rows)}; logs in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
