"""The demo's cycles without Dagster: `--quick`'s policy (named, and its minimums met by `QUICK_TRAINING`),
summary lines that tell checks not passed from checks never run, and the pointer moved after whichever
cycle first earns promotion."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from lightning_dagster.demo import QUICK_TRAINING, cycles
from lightning_dagster.demo.quick import QUICK_POLICY
from lightning_dagster.gate.checks import evaluate
from lightning_dagster.gate.policy import DEFAULT_POLICY, load_policy
from lightning_dagster.gate.receipt import parse_receipt, with_gate_record
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.stages.snapshot import policy_shortfalls
from lightning_dagster.types import RolloutKind
from tests.gate.conftest import raw
from tests.gate.test_stopped_graph import stopped_after_heldout

PROMOTE, HOLD = cycles.PROMOTE, "HOLD"


def quick_plan():
    """A plan of `QUICK_TRAINING`'s sizes (held-out tasks, canary tasks) and the demo's approver roles."""
    plan = parse_receipt(raw("a")).plan
    holdout = plan.holdout_snapshot.model_copy(update={"n_tasks": QUICK_TRAINING["holdout_tasks"]})
    expected = {**plan.expected_rollouts, RolloutKind.canary: QUICK_TRAINING["canary_tasks"]}
    return plan.model_copy(update={"holdout_snapshot": holdout, "expected_rollouts": expected})


def test_the_quick_policy_is_named_and_its_minimums_are_met_by_the_quick_sizes():
    quick, default = load_policy(QUICK_POLICY), load_policy(None)
    assert quick.version == "quick-v1" and default.version == DEFAULT_POLICY == "default-v1"
    assert quick.checks.heldout_margin.min_n <= QUICK_TRAINING["holdout_tasks"]
    assert policy_shortfalls(quick_plan(), quick) == []
    # The default is unchanged: 100 held-out tasks, which --quick's plan cannot have.
    assert default.checks.heldout_margin.min_n == 100
    assert any("check 4 needs at least 100" in s for s in policy_shortfalls(quick_plan(), default))
    # Only check 4 differs from the default.
    differs = [c for c in quick.checks.model_fields if getattr(quick.checks, c) != getattr(default.checks, c)]
    assert differs == ["heldout_margin"] and (quick.staleness, quick.stop) == (
        default.staleness,
        default.stop,
    )


@pytest.mark.parametrize(("flags", "policy"), [(["--quick"], str(QUICK_POLICY)), ([], None)])
def test_quick_selects_the_quick_policy_for_the_demo(flags, policy, monkeypatch):
    import lightning_dagster.demo as demo
    from lightning_dagster.cli import main

    monkeypatch.setenv("LD_GATE_POLICY", "")
    monkeypatch.delenv("LD_GATE_POLICY")
    seen = []
    monkeypatch.setattr(
        demo, "run_demo", lambda *a, **kw: seen.append(os.environ.get("LD_GATE_POLICY")) or []
    )
    assert main(["demo", *flags]) == 0
    assert seen == [policy]


def test_the_summary_line_tells_checks_not_passed_from_checks_never_run():
    cycle = cycles.Cycle(
        1, "snap-1", HOLD, "rcpt-1", ["4 heldout_margin"], ["6 canary_verified"], policy="quick-v1"
    )
    assert cycle.line() == (
        "verdict: cycle 1 (snap-1): HOLD under quick-v1 (receipt rcpt-1); checks not passed: 4 heldout_margin; "
        "checks never run: 6 canary_verified"
    )
    assert "never run" not in cycles.Cycle(2, "k", PROMOTE, "r", policy="default-v1").line()


def test_a_cycle_stopped_by_a_blocking_check_lists_the_checks_after_it_as_never_run(monkeypatch):
    data = stopped_after_heldout()
    data["plan"]["parent"]["model_version"] = "1"
    receipt = parse_receipt(data)
    judged = with_gate_record(receipt, evaluate(receipt, load_policy(None)).to_record())
    assert judged.gate.failed_checks == [4] and sorted(judged.gate.unavailable_checks) == [6, 7]
    monkeypatch.setattr(cycles, "run_graph", lambda *a, **kw: None)
    monkeypatch.setattr(ctx, "find_receipt", lambda store, key: judged)
    demo = SimpleNamespace(actors={"release-owner": "o"}, defs=None, instance=None, lines=None, queued={})
    demo.pipeline = SimpleNamespace(get_store=lambda: None)
    cycle = cycles.run_cycle(demo, 1, "snap-1")
    assert (cycle.verdict, cycle.policy, cycle.parent_version) == (HOLD, "default-v1", "1")
    assert cycle.not_passed == ["4 heldout_margin"]
    assert cycle.never_ran == ["6 canary_verified", "7 rollback_and_approval"]


class FakeDemo:
    """What `run_cycles` and `promote` touch: lines, the working copy, the jobs, the registry's pointer."""

    def __init__(self):
        self.version, self.said, self.ran = 1, [], []
        self.actors = {"default-approver": "bob"}
        self.pipeline = self.instance = None
        self.copy = SimpleNamespace(add_late_tasks=lambda: 3, tasks_file="tasks.jsonl")
        self.lines = SimpleNamespace(line=lambda stage, text: self.said.append(f"{stage}: {text}"))

    def run_job(self, demo, name, run_config, **kw):
        self.ran.append(name)
        if name == "promote":
            self.version += 1
        return True, []

    def registry(self):
        return SimpleNamespace(current=lambda alias: self.version)


@pytest.mark.parametrize(
    ("verdicts", "promoted"),
    [((HOLD, PROMOTE), [2]), ((PROMOTE, PROMOTE), [1]), ((PROMOTE, HOLD), [1]), ((HOLD, HOLD), [])],
)
def test_the_pointer_moves_after_whichever_cycle_first_earns_promotion(verdicts, promoted, monkeypatch):
    demo, summaries = FakeDemo(), []
    monkeypatch.setattr(cycles, "bootstrap", lambda d: "1")
    monkeypatch.setattr(cycles, "tick", lambda d: "snap")
    monkeypatch.setattr(cycles, "approval_config", lambda *a: {})
    monkeypatch.setattr(cycles, "promotion_config", lambda *a: {})
    made = iter(verdicts)
    monkeypatch.setattr(cycles, "run_cycle", lambda d, n, k: cycles.Cycle(n, k, next(made), f"rcpt-{n}"))
    monkeypatch.setattr(cycles, "summary", lambda d, cs, before, after: summaries.append((before, after)))
    monkeypatch.setattr(cycles, "keep_cursor", lambda d: None)
    monkeypatch.setattr(cycles, "run_job", demo.run_job)
    first, second = cycles.run_cycles(demo)
    assert [c.number for c in (first, second) if c.promoted] == promoted
    assert demo.ran == ["approve", "promote"] * len(promoted)
    assert summaries == [("1", str(1 + len(promoted)))]
    for number in promoted:
        assert f"promotion: approved-default -> 2 by bob (receipt rcpt-{number})" in demo.said
    if verdicts[0] == HOLD:
        assert "promotion: not attempted: cycle 1 ended HOLD" in demo.said
