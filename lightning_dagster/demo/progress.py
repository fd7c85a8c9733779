"""One printed line per stage as it happens: the warm start's progress, and each materialization, failed
check or failed step of a Dagster run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# The demo prints its own lines; Dagster's per-event console log would drown them.
QUIET: dict[str, Any] = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
WARM_START_EVERY = 25  # SFT steps between warm-start lines (a probe always prints)


class StageLines:
    """Prints `[ elapsed s] stage: figures` lines, elapsed since the demo started."""

    def __init__(self, out: Callable[[str], None] = print) -> None:
        self.started = time.perf_counter()
        self.out = out

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def line(self, stage: str, text: str) -> None:
        self.out(f"[{self.elapsed():4.0f}s] {stage}: {text}")

    def warm_start(self, metrics: dict) -> None:
        """The warm start's progress: a line per probe, the first step and every WARM_START_EVERY steps."""
        step = metrics.get("step", 0)
        if "chosen_step" in metrics:
            self.line(
                "warm start",
                f"no probe reached the target by step {step}: keeping the checkpoint of step "
                f"{metrics['chosen_step']} (probe {metrics['probe_success']:.2f}, the nearest to it)",
            )
        elif "probe_success" in metrics:
            self.line("warm start", f"{step} SFT steps, probe {metrics['probe_success']:.2f}")
        elif step == 1 or step % WARM_START_EVERY == 0:
            self.line("warm start", f"{step} SFT steps, nll {metrics.get('nll', 0.0):.3f}")


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def asset_figures(asset: str, meta: dict[str, Any], training: Any) -> str:
    m = meta.get
    if asset == "tasks":
        return ", ".join(f"{s} {m(f'{s}_tasks')}" for s in ("train", "holdout", "protected", "canary"))
    if asset == "update_plan":
        return f"parent {m('parent')}, expected rollouts {m('expected_rollouts')}"
    if asset == "rollouts":
        failed = "".join(f"\n  {line}" for line in m("failures") or [])
        return (
            f"{m('rollouts')} rollouts from the parent ({m('rollouts_per_s')}/s), "
            f"reward mean {_fmt(m('reward_mean'))}, retries {m('retries')}{failed}"
        )
    if asset == "spans":
        return f"{m('spans')} spans, coverage {m('coverage')}"
    if asset == "training_transitions":
        return f"{m('rows')} rows, {m('trained_tokens')} trained tokens"
    if asset == "candidate_resource":
        per_step = training.tasks_per_step * training.group_size
        chosen = (
            f"checkpoint of step {m('chosen_step')}" if m("chosen_step") is not None else "last checkpoint"
        )
        stopped = f" ({m('early_stop')})" if m("early_stop") else ""
        unchanged = (
            "; no step had a learning signal (in every group all rewards were equal), so the candidate "
            "has the parent's weights"
            if m("trained_rows") == 0
            else ""
        )
        return (
            f"{m('steps')} of {training.steps} RL steps x {per_step} rollouts{stopped}, final sampled reward "
            f"{_fmt(m('final_reward'))}, {chosen}; candidate {m('model_version')}{unchanged}"
        )
    if asset == "holdout_evaluation":
        return (
            f"held-out success parent {_fmt(m('parent_success'))} -> candidate {_fmt(m('candidate_success'))} "
            f"(margin {m('margin'):+.3f}, n {m('heldout_tasks')}); protected regressions "
            f"{m('protected_regressions')} of {m('protected_cases')}"
        )
    if asset == "canary_results":
        return f"verified {m('verified')}, harmful effects {m('harmful_effects')}, {m('seconds')} s"
    if asset == "rollback_drill":
        steps = ("resolved", "bytes_verified", "loaded", "served")
        return ", ".join(f"{s} {m(s)}" for s in steps) + f" ({m('seconds')} s)"
    if asset == "release_receipt":
        return f"verdict {m('verdict')} under policy {m('policy')}"
    return ""


class EventLines:
    """A run's events as stage lines; `after` (asset -> callable) runs right after that materialization."""

    def __init__(
        self, lines: StageLines, label: str, training: Any, after: dict[str, Callable[[], None]] | None = None
    ) -> None:
        self.lines, self.label, self.training, self.after = lines, label, training, after or {}
        self.materialized: list[str] = []  # the assets materialized, in order

    def __call__(self, event: Any) -> None:
        if event.event_type_value == "ASSET_MATERIALIZATION":
            materialization = event.step_materialization_data.materialization
            asset = materialization.asset_key.to_user_string()
            meta = {k: v.value for k, v in materialization.metadata.items()}
            self.lines.line(f"{self.label} {asset}", asset_figures(asset, meta, self.training))
            self.materialized.append(asset)
            if asset in self.after:
                self.after[asset]()
        elif event.event_type_value == "ASSET_CHECK_EVALUATION" and not event.event_specific_data.passed:
            evaluation = event.event_specific_data
            reason = evaluation.metadata.get("reason")
            why = f": {reason.value}" if reason is not None and reason.value else ""
            self.lines.line(f"{self.label} check", f"{evaluation.check_name} not passed{why}")
        elif event.is_step_failure:
            error = event.step_failure_data.error
            while error is not None and error.cause is not None:  # the user code's own error, not Dagster's
                error = error.cause
            if error is not None and error.cls_name == "DagsterAssetCheckFailedError":
                # the check's own line came just before; the receipt names each stage that did not run
                text = f"blocking check step {event.step_key} failed: the assets after it do not run"
            else:
                cause = (error.message.strip().splitlines() or [""])[0] if error is not None else ""
                text = f"{event.step_key} did not run to the end: {cause}"
            self.lines.line(f"{self.label} stopped", text)


def run_snapshot(
    defs: Any,
    instance: Any,
    key: str,
    *,
    approver: tuple[str, str] | None,
    cut: dict[str, Any] | None = None,
) -> list[Any]:
    """Plan, optionally approve the canary step, then materialize the rest of the snapshot's graph, each as
    a run on `instance`. `cut`: what the sensor that cut the snapshot decided (`Cut.config`), for `tasks` to
    freeze. Returns the run results."""
    from lightning_dagster.demo.setup import approval_config
    from lightning_dagster.orchestration.assets import snapshot_assets

    job = defs.resolve_job_def("continual_learning")
    planned = ["tasks", "update_plan"]
    first = {**QUIET, "ops": {"tasks": {"config": cut}}} if cut else QUIET
    results = [_run(job, instance, key, planned, first)]
    if approver is not None:
        approval = approval_config(defs.resources["pipeline"], key, approver)
        results.append(
            defs.resolve_job_def("approve").execute_in_process(
                instance=instance, run_config={**QUIET, "ops": {"approve_receipt": {"config": approval}}}
            )
        )
    rest = [a.key.to_user_string() for a in snapshot_assets if a.key.to_user_string() not in planned]
    results.append(_run(job, instance, key, rest, QUIET))
    events = results[-1].get_asset_materialization_events()
    if not any(e.materialization.asset_key.to_user_string() == "release_receipt" for e in events):
        # a blocking check stopped the graph: the receipt alone judges all seven checks (no bypass)
        results.append(_run(job, instance, key, ["release_receipt"], QUIET))
    return results


def _run(job: Any, instance: Any, key: str, selection: list[str], config: dict[str, Any]) -> Any:
    import dagster as dg

    return job.execute_in_process(
        instance=instance,
        partition_key=key,
        asset_selection=[dg.AssetKey(name) for name in selection],
        raise_on_error=False,
        run_config=config,
    )
