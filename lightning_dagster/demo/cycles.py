"""The demo's two release cycles, every tick and run the code location's (`location.Location`), so the
Dagster UI shows them."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from lightning_dagster.demo.progress import EventLines, StageLines
from lightning_dagster.demo.setup import (
    DEMO_ACTORS,
    WorkingCopy,
    approval_config,
    approver_keys,
    promotion_config,
)

PROMOTE = "PROMOTE TO BOUNDED CANARY"
SENSOR = "continual_learning_sensor"


@dataclass
class Cycle:
    number: int
    key: str
    verdict: str | None = None
    receipt_id: str | None = None
    not_passed: list[str] = field(default_factory=list)  # judged and not passed
    never_ran: list[str] = field(default_factory=list)  # their stage never ran (stopped upstream)
    parent_version: str | None = None
    policy: str | None = None
    promoted: bool = False

    def line(self) -> str:
        head = f"verdict: cycle {self.number} ({self.key}):"
        if self.verdict is None:
            return f"{head} none -- no receipt was judged"
        checks = f"; checks not passed: {', '.join(self.not_passed)}" if self.not_passed else ""
        checks += f"; checks never run: {', '.join(self.never_ran)}" if self.never_ran else ""
        return f"{head} {self.verdict} under {self.policy} (receipt {self.receipt_id}){checks}"


@dataclass
class Demo:
    """What the demo runs on: the code location, Dagster's instance, the project's working copy."""

    defs: Any
    instance: Any
    copy: WorkingCopy
    lines: StageLines
    env: dict[str, str]  # what the printed commands set (home, Dagster home, roles file, project)
    actors: dict[str, str] = field(default_factory=lambda: dict(DEMO_ACTORS))
    location: Any = None  # the code location the printed `dagster dev` serves (`location.Location`)
    cursor: str | None = None
    queued: dict[str, str] = field(default_factory=dict)  # snapshot key -> the queued run of its cut

    @property
    def pipeline(self) -> Any:
        return self.defs.resources["pipeline"]

    def registry(self) -> Any:
        from lightning_dagster.pipeline import context as ctx

        return ctx.registry(self.pipeline)


def bootstrap(demo: Demo) -> str:
    """The first parent (warm start with a line per probe), made `approved-default`; returns its version."""
    from lightning_dagster.pipeline.bootstrap import bootstrap_parent

    meta = bootstrap_parent(demo.pipeline, progress=demo.lines.warm_start).metadata
    if not meta.get("bootstrapped"):
        how = "existing"
    elif not meta.get("warm_start_steps"):
        how = f"base model {meta['base_model']}, no warm start"
    else:
        steps, run = meta["warm_start_steps"], meta.get("warm_start_steps_run", meta["warm_start_steps"])
        kept = f"the checkpoint of step {steps} of {run}" if steps != run else f"{steps} SFT steps"
        how = f"warm start {kept}, probe {meta['probe_success']:.2f}, {meta['seconds']} s"
    demo.lines.line("parent", f"approved-default = version {meta['approved_default']} ({how})")
    return str(meta["approved_default"])


def run_job(
    demo: Demo, job: str, run_config: dict[str, Any], *, run_id: str | None = None, **selection: Any
) -> tuple[bool, list[str]]:
    """Launch the queued `run_id`, else a run of `job` submitted now; whether it succeeded, its failures."""
    on_event = selection.pop("on_event", None)
    run_id = run_id or demo.location.submit(job, run_config, **selection).run_id
    failures: list[str] = []

    def follow(event: Any) -> None:
        if event.is_step_failure:
            error = event.step_failure_data.error
            failures.append(error.message.strip() if error is not None else str(event.step_key))
        if on_event is not None:
            on_event(event)

    done = demo.location.launch(run_id, demo.defs.resolve_job_def(job), follow)
    return done.status.value == "SUCCESS", failures


def tick(demo: Demo) -> str | None:
    """One real tick of `continual_learning_sensor`: the key it cut (its run queued), or None."""
    tick = demo.location.tick(SENSOR, demo.cursor)
    demo.cursor = demo.location.cursor(SENSOR)
    if not tick.run_ids:
        demo.lines.line("sensor", tick.skip_reason or "skipped")
        return None
    (run_id,) = tick.run_ids
    key = demo.instance.get_run_by_id(run_id).tags["dagster/partition"]
    demo.queued[key] = run_id
    demo.lines.line("sensor", f"cut snapshot {key}")
    return key


def cut_by_hand(demo: Demo, number: int) -> str:
    """A snapshot cut by the demo (when the sensor paused), its run submitted as a launchpad run."""
    import datetime as dt

    from lightning_dagster.orchestration.partitions import snapshots
    from lightning_dagster.pipeline.triggers import Watermark, cut_snapshot, new_evidence

    evidence = new_evidence(demo.pipeline, Watermark.from_cursor(demo.cursor), force=True)
    cut = cut_snapshot(demo.pipeline, evidence, dt.datetime.now(dt.UTC))
    demo.cursor = evidence.watermark.to_cursor()
    demo.instance.add_dynamic_partitions(snapshots.name, [cut.key])
    config = {"ops": {"tasks": {"config": cut.config}}}
    run = demo.location.submit("continual_learning", config, partition=cut.key, tags={"trigger": "demo"})
    demo.queued[cut.key] = run.run_id
    demo.lines.line("snapshot", f"{cut.key} cut by the demo for cycle {number}")
    return cut.key


def run_graph(demo: Demo, number: int, key: str) -> None:
    """The queued run of `key`'s cut, the release owner approving the canary step right after
    `update_plan`; then `release_receipt` alone if a blocking check stopped the graph (it judges all seven
    checks itself: no bypass)."""
    from lightning_dagster.demo.setup import approval_config
    from lightning_dagster.pipeline import context as ctx

    label, owner = f"cycle {number}", demo.actors["release-owner"]

    def approve_canary() -> None:
        approval = approval_config(demo.pipeline, key, (owner, "release-owner"))
        ok, failures = run_job(demo, "approve", {"ops": {"approve_receipt": {"config": approval}}})
        said = f"{owner} signed the canary step (release-owner)" if ok else f"refused: {'; '.join(failures)}"
        demo.lines.line(f"{label} approve", said)

    training = ctx.settings(demo.pipeline).training
    printer = EventLines(demo.lines, label, training, after={"update_plan": approve_canary})
    run_job(demo, "continual_learning", {}, run_id=demo.queued.pop(key), on_event=printer)
    if "release_receipt" not in printer.materialized:
        printer.after = {}
        run_job(demo, "continual_learning", {}, partition=key, assets=["release_receipt"], on_event=printer)


def run_cycle(demo: Demo, number: int, key: str) -> Cycle:
    from lightning_dagster.pipeline import context as ctx

    run_graph(demo, number, key)
    cycle = Cycle(number, key)
    receipt = ctx.find_receipt(demo.pipeline.get_store(), key)
    if receipt is not None:
        cycle.parent_version = ctx.registered_version(receipt.plan.parent)
    if receipt is not None and receipt.gate is not None:
        gate = receipt.gate
        cycle.verdict, cycle.receipt_id, cycle.policy = gate.verdict, receipt.receipt_id, gate.policy_version
        failed = {*gate.failed_checks, *gate.unavailable_checks, *gate.stale_checks}
        never = ctx.never_ran(receipt)
        cycle.not_passed = [f"{c} {c.name}" for c in sorted(failed - never)]
        cycle.never_ran = [f"{c} {c.name}" for c in sorted(failed & never)]
    return cycle


def promote(demo: Demo, cycle: Cycle) -> str:
    """The default approver's signed `promote` run, when the verdict earned it; returns approved-default."""
    from lightning_dagster.registry.core import APPROVED

    if cycle.verdict != PROMOTE:
        demo.lines.line("promotion", f"not attempted: cycle {cycle.number} ended {cycle.verdict}")
        return str(demo.registry().current(APPROVED))
    actor = demo.actors["default-approver"]
    approval = approval_config(demo.pipeline, cycle.key, (actor, "default-approver"))
    for job, op, config in (
        ("approve", "approve_receipt", lambda: approval),
        # signed once the approval is recorded: the move binds the receipt version that holds it
        ("promote", "promote_candidate", lambda: promotion_config(demo.pipeline, cycle.receipt_id, actor)),
    ):
        ok, failures = run_job(demo, job, {"ops": {op: {"config": config()}}})
        if not ok:
            demo.lines.line("promotion", f"refused: {failures[0] if failures else job}")
            return str(demo.registry().current(APPROVED))
    after, cycle.promoted = str(demo.registry().current(APPROVED)), True
    demo.lines.line("promotion", f"approved-default -> {after} by {actor} (receipt {cycle.receipt_id})")
    return after


def run_cycles(demo: Demo) -> list[Cycle]:
    """Bootstrap, cycle 1, new tasks, the sensor's snapshot 2, cycle 2, summary; promotes the first earned."""
    before = bootstrap(demo)
    key1 = tick(demo) or cut_by_hand(demo, 1)
    first = run_cycle(demo, 1, key1)
    after = promote(demo, first)
    tick(demo)  # nothing new yet: the sensor says what it waits for
    demo.lines.line("new tasks", f"{demo.copy.add_late_tasks()} train tasks added to {demo.copy.tasks_file}")
    key2 = tick(demo) or cut_by_hand(demo, 2)
    second = run_cycle(demo, 2, key2)
    if not first.promoted:
        after = promote(demo, second)
    tick(demo)  # what the loop does next: waits for new evidence, or is paused (the condition and receipt)
    keep_cursor(demo)
    summary(demo, [first, second], before, after)
    return [first, second]


def keep_cursor(demo: Demo) -> None:
    """Keep the sensor's watermark as its cursor for the printed `dagster dev` (new evidence only)."""
    demo.location.set_cursor(SENSOR, demo.cursor)
    demo.lines.line("sensor", "cursor kept for the UI: switching the sensor on cuts only new evidence")


def summary(demo: Demo, cycles: list[Cycle], before: str, after: str) -> None:
    from lightning_dagster import paths
    from lightning_dagster.registry.pointers import move_dict

    out = demo.lines.out
    out("")
    out(f"summary ({demo.lines.elapsed():.0f} s)")
    for cycle in cycles:
        out(cycle.line())
    second = cycles[-1]
    source = "the unchanged default" if second.parent_version == before else "the promoted candidate"
    out(f"cycle 2 trained from approved-default {second.parent_version}: {source}")
    out(f"approved-default: {before} -> {after}")
    out("pointer history (lightning-dagster registry history):")
    for move in demo.registry().history():
        row = move_dict(move)
        receipt = f" receipt {row['receipt_id']}" if row["receipt_id"] else ""
        out(f"  {row['seq']:>3}  {row['at']}  {row['from'] or '-'} -> {row['to']}  {row['actor']}{receipt}")
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in demo.env.items())
    out("")
    out("where to look next:")
    # the Dagster UI links model versions and runs to the MLflow UI the next line starts (LD_MLFLOW_UI_URL)
    out(
        f"  Dagster UI:  {exports} LD_MLFLOW_UI_URL=http://127.0.0.1:5000 "
        "dagster dev -m lightning_dagster.orchestration.definitions -h 127.0.0.1 -p 3000"
    )
    out(
        f"  MLflow UI:   mlflow ui --backend-store-uri {shlex.quote(paths.mlflow_tracking_uri())} "
        f"--default-artifact-root {shlex.quote(str(paths.mlflow_artifact_root()))} -h 127.0.0.1 -p 5000"
    )
    out(f"  history:     {exports} lightning-dagster registry history")
    if second.verdict == PROMOTE and not second.promoted:
        promoter, policy = demo.actors["default-approver"], demo.env.get("LD_GATE_POLICY")
        out(
            f"  promote 2:   {exports} lightning-dagster registry promote {second.receipt_id} "
            f"--actor {promoter} --key {shlex.quote(str(approver_keys() / f'{promoter}.key'))}"
            + (f" --policy-path {shlex.quote(policy)}" if policy else "")  # the policy that judged it
        )
