"""The runner: N workers claim rollouts and run attempts of a harness under the retry policy; a reaper ends
attempts whose heartbeat went stale `unresponsive`. A failed attempt while the gateway does not answer ends
`gateway_unreachable`, and claims pause meanwhile."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from lightning_dagster import paths
from lightning_dagster.gateway.keys import attempt_key
from lightning_dagster.project.agl_launcher import post_reward, reward_value
from lightning_dagster.runner.execute import (
    Outcome,
    Sandbox,
    check_passthrough,
    check_sandbox,
    harness_env,
    run_inprocess,
    run_subprocess,
    task_note,
    write_task_file,
)
from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.runner.retry import RetryPolicy
from lightning_dagster.runner.summary import RunSummary, summarize
from lightning_dagster.runner.transcript import Decode, transcript
from lightning_dagster.store import Store
from lightning_dagster.store.errors import Conflict, NotFound, StoreLocked
from lightning_dagster.store.queue import FINAL_ROLLOUT_STATUSES
from lightning_dagster.types import (
    Attempt,
    AttemptState,
    IllegalTransition,
    Rollout,
    RolloutStatus,
    Span,
    SpanKind,
)

log = logging.getLogger(__name__)
LIVE_ROLLOUT = frozenset(RolloutStatus) - FINAL_ROLLOUT_STATUSES
RUNNER_SPAN_SEQUENCE = 1_000_000  # runner-recorded spans: far above the gateway's sequence numbers
IDLE_POLL_S = (0.05, 1.0)  # an idle worker's store polls: first wait, then doubling up to the second
GATEWAY_PROBE_S = 2.0  # how long a health probe waits for the gateway to answer


class WrongHarness(ValueError):
    """A rollout was handed to a runner for a different harness."""


class Runner:
    """Runs the rollouts of one harness through a gateway until each is final (`decode`: for the judge)."""

    def __init__(
        self,
        store: Store,
        gateway_url: str,
        *,
        secret: str,
        harness: HarnessSpec,
        parallel: int = 8,
        policy: RetryPolicy | None = None,
        mode: Literal["subprocess", "inprocess"] = "subprocess",
        workdir: Path | None = None,
        decode: Decode | None = None,
        sandbox: Sandbox = "none",
        env_passthrough: Sequence[str] = (),
    ) -> None:
        if mode not in ("subprocess", "inprocess"):
            raise ValueError(f"mode must be 'subprocess' or 'inprocess', got {mode!r}")
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.store = store
        self.gateway_url = gateway_url.rstrip("/")
        self.secret = secret
        self.harness = harness
        self.parallel = parallel
        self.policy = policy or harness.retry_policy()
        self.mode = harness.run_mode(mode)
        if sandbox != "none" and self.mode == "inprocess":
            raise ValueError(f"harness {harness.name!r} runs in-process here: a sandbox needs a subprocess")
        check_sandbox(sandbox)
        self.workdir = workdir or paths.home() / "attempts"
        self.decode = decode
        self.sandbox = sandbox
        self.env_passthrough = check_passthrough((*harness.env_passthrough, *env_passthrough))
        self.runner_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._lock = threading.Lock()
        self._busy = 0  # rollouts a worker or the reaper is handling right now
        self._active: set[str] = set()  # attempt ids a live worker of ours is running or ending
        self._outage_since: float | None = None  # monotonic time an attempt first found the gateway down
        self.driven = 0  # rollouts this runner claimed
        self._queued_hint = True  # the last claim found a rollout (so try the next claim without a count)

    def run(self, rollout_ids: list[str] | None = None) -> RunSummary:
        """Run until every given rollout (default: every queued rollout of this harness) is final."""
        started = time.monotonic()
        if rollout_ids is None:
            queued = self.store.query_rollouts(status=RolloutStatus.queued)
            rollout_ids = [r.rollout_id for r in queued if r.harness == self.harness.name]
        ids = list(rollout_ids)
        self._check(ids)
        self._loop(ids, lambda: self._none_live(rollout_ids=ids), threading.Event())
        return summarize(
            self.store,
            ids,
            self.harness,
            policy=self.policy,
            wall_s=time.monotonic() - started,
            mode=self.mode,
            workdir=self.workdir,
        )

    def work(self, *, until_idle: bool = False, stop: threading.Event | None = None) -> int:
        """Fleet worker: run rollouts until `stop` (or, `until_idle`, none is live); how many it claimed."""
        stop = stop or threading.Event()
        name = self.harness.name
        self._loop(None, lambda: stop.is_set() or (until_idle and self._none_live(harness=name)), stop)
        return self.driven

    def _loop(self, ids: list[str] | None, done: Callable[[], bool], stop: threading.Event) -> None:
        """Workers and the reaper over `ids` (None: every rollout of this harness) until `done()`."""
        threads = [threading.Thread(target=self._reap_loop, args=(ids, stop), name="reaper", daemon=True)]
        threads += [
            threading.Thread(target=self._work_loop, args=(f"{self.runner_id}-w{i}", ids, stop), daemon=True)
            for i in range(self.parallel)
        ]
        for thread in threads:
            thread.start()
        try:
            while not done():
                stop.wait(0.1)
        finally:
            stop.set()
            for thread in threads:
                thread.join()

    def _check(self, ids: list[str]) -> None:
        """Refuse, before anything runs, rollout ids that do not exist or belong to another harness."""
        found = {r.rollout_id: r for r in self.store.query_rollouts(rollout_ids=ids)}
        missing = [i for i in ids if i not in found]
        if missing:
            raise NotFound(f"unknown rollouts: {', '.join(missing[:5])}")
        foreign = [i for i, r in found.items() if r.harness not in (None, self.harness.name)]
        if foreign:
            raise WrongHarness(f"rollouts {', '.join(foreign[:5])} are not for harness {self.harness.name!r}")

    def _none_live(self, **scope) -> bool:
        """No rollout of `scope` is handled here, queued or running anywhere."""
        with self._lock:
            if self._busy:
                return False
        return self.store.count_rollouts(status=LIVE_ROLLOUT, **scope) == 0

    def _next(self, worker_id: str, ids: list[str] | None) -> tuple[Rollout, Attempt] | None:
        """Claim a queued rollout; busy from here on, so the run cannot look finished before it is final."""
        with self._lock:
            self._busy += 1
        claimed = None
        try:
            # a read first (claims take the write lock from span writes), unless the last claim found one
            scope = {"rollout_ids": ids} if ids is not None else {"harness": self.harness.name}
            if self._queued_hint or self.store.count_rollouts(status=RolloutStatus.queued, **scope):
                # a rollout tagged with a policy version starts once every live server serves it
                ready = self.store.fleet_version()
                versions = () if ready is None else (ready,)
                claimed = self.store.claim_rollout(worker_id, policy_versions=versions, **scope)
                self._queued_hint = claimed is not None
        finally:
            if claimed is None:
                self._release()
        if claimed is not None:
            with self._lock:
                self.driven += 1
        return claimed

    def _release(self) -> None:
        with self._lock:
            self._busy -= 1

    def _work_loop(self, worker_id: str, ids: list[str] | None, stop: threading.Event) -> None:
        idle = IDLE_POLL_S[0]
        while not stop.is_set():
            claimed = None
            if not self._holding():
                try:
                    claimed = self._next(worker_id, ids)
                except StoreLocked as err:  # other writers held the store: the next poll claims again
                    log.warning("claim waited too long, retrying: %s", err)
                except Exception:  # noqa: BLE001 - a store hiccup must not kill the worker
                    log.exception("claim failed")
            if claimed is None:
                # holding, or nothing queued: back off, or idle workers starve those still running
                stop.wait(idle)
                idle = min(idle * 2, IDLE_POLL_S[1])
                continue
            idle = IDLE_POLL_S[0]
            try:
                self._drive(worker_id, *claimed)
            except Exception:  # noqa: BLE001 - the attempt stays running and the reaper ends it
                log.exception("worker %s lost rollout %s", worker_id, claimed[0].rollout_id)
            finally:
                self._release()

    def _drive(self, worker_id: str, rollout: Rollout, attempt: Attempt) -> None:
        """Run attempts of one rollout until the policy says it is final."""
        while True:
            # ours until its ending and the policy's decision are written: the reaper leaves it alone
            with self._lock:
                self._active.add(attempt.attempt_id)
            try:
                try:
                    outcome = self._attempt(rollout, attempt)
                except Exception as exc:  # noqa: BLE001 - a runner-side failure still ends the attempt
                    outcome = Outcome(AttemptState.failed, "runner_error", f"{type(exc).__name__}: {exc}")
                retry = self._after(self._end(attempt, self._blame_gateway(outcome)))
            finally:
                with self._lock:
                    self._active.discard(attempt.attempt_id)
            if retry is None:
                return
            try:
                attempt = self.store.start_attempt(retry.attempt_id, worker_id)
            except IllegalTransition:
                return  # another worker claimed the retry first, or it was cancelled

    def _end(self, attempt: Attempt, outcome: Outcome | None) -> Attempt:
        """Write the ending; if the reaper or an operator ended the attempt first, their ending stands."""
        if outcome is None:
            return self.store.get_attempt(attempt.attempt_id)
        try:
            return self.store.transition_attempt(
                attempt.attempt_id,
                outcome.state,
                reason_code=outcome.reason_code,
                reason_message=outcome.reason_message,
            )
        except IllegalTransition:
            return self.store.get_attempt(attempt.attempt_id)

    def _after(self, ended: Attempt) -> Attempt | None:
        """Apply the policy to an ended attempt; returns the retry when it may start at once (no backoff)."""
        kind = self.policy.retry_kind(ended)
        if kind is not None:
            delay = self.policy.delay_s(ended, kind)
            try:
                retry = self.store.retry_rollout(ended.rollout_id, kind, delay_s=delay)
            except Conflict:
                return None  # another runner process already retried it
            return retry if delay == 0 else None
        final = {
            AttemptState.succeeded: RolloutStatus.succeeded,
            AttemptState.cancelled: RolloutStatus.cancelled,
        }.get(ended.state, RolloutStatus.failed)
        self.store.finish_rollout(ended.rollout_id, final)
        return None

    def _unreachable(self) -> str | None:
        """Why the gateway does not answer, or None when it does (any HTTP status counts as an answer)."""
        try:
            urllib.request.urlopen(f"{self.gateway_url}/v1/models", timeout=GATEWAY_PROBE_S).close()
        except urllib.error.HTTPError:
            return None
        except (urllib.error.URLError, OSError) as exc:
            return str(getattr(exc, "reason", exc))
        return None

    def _blame_gateway(self, outcome: Outcome | None) -> Outcome | None:
        """A failed attempt while the gateway does not answer is the gateway's failure; claims pause."""
        if outcome is None or outcome.state not in (AttemptState.failed, AttemptState.timeout):
            return outcome
        why = self._unreachable()
        if why is None:
            return outcome
        with self._lock:
            if self._outage_since is None:
                self._outage_since = time.monotonic()
        message = f"gateway unreachable at {self.gateway_url}: {why}\n{outcome.reason_message or ''}"
        return Outcome(outcome.state, "gateway_unreachable", message.strip())

    def _holding(self) -> bool:
        """Whether to start no attempt: the gateway, found down under `backoff_max_s` ago, still is."""
        with self._lock:
            since = self._outage_since
        if since is None or time.monotonic() - since >= self.policy.backoff_max_s:
            return False
        if self._unreachable() is not None:
            return True
        with self._lock:
            self._outage_since = None
        return False

    def _attempt(self, rollout: Rollout, attempt: Attempt) -> Outcome | None:
        """Prepare, run and check one attempt; None when someone else ended it meanwhile."""
        notice: list[str] = []
        outcome = self._run_attempt(rollout, attempt, notice)
        note = "\n".join(line for line in notice if line)
        if outcome is None or not note:
            return outcome
        message = f"{outcome.reason_message}\n{note}" if outcome.reason_message else note
        return dataclasses.replace(outcome, reason_message=message)

    def _run_attempt(self, rollout: Rollout, attempt: Attempt, notice: list[str]) -> Outcome | None:
        rollout_id, attempt_id = rollout.rollout_id, attempt.attempt_id
        workdir = self.workdir / rollout_id / attempt_id
        task = rollout.task
        if self.harness.prepare is not None:
            try:
                task = self.harness.prepare(task, workdir)
            except Exception as exc:  # noqa: BLE001 - a broken environment is this attempt's failure
                return Outcome(AttemptState.failed, "prepare_error", f"{type(exc).__name__}: {exc}")
        key = attempt_key(self.secret, rollout_id, attempt_id)
        # The attempt's own variables win over a task field mapped onto the same name.
        task_json = json.dumps(task)
        task_file = write_task_file(workdir, task_json) if self.mode == "subprocess" else None
        env = {
            **self.harness.task_env(task),
            **harness_env(self.gateway_url, key, rollout_id, attempt_id, task_json, task_file=task_file),
        }
        if note := task_note(env, task_json):  # said in the log and at the end of the attempt's reason
            log.info("attempt %s: %s", attempt_id, note)
            notice.append(note)
        supervise_kw = {
            "timeout_s": self.policy.timeout_s,
            "heartbeat_interval_s": self.policy.heartbeat_interval_s,
            "heartbeat": lambda: self._heartbeat(attempt_id),
        }
        if self.mode == "subprocess":
            argv = self.harness.command()
            failure, verdict, cut = run_subprocess(
                argv, env, workdir, supervise_kw, cwd=self.harness.cwd, passthrough=self.env_passthrough,
                sandbox=self.sandbox, hide=[paths.home()], max_output_bytes=self.harness.max_output_bytes,
            )  # fmt: skip
            notice.append(cut)
        else:
            failure, verdict = run_inprocess(self.harness.run_task, task, env, supervise_kw)
        if self.harness.verify is not None:
            # Verified whatever the ending: a failed or timed-out attempt may still have done harm.
            self._record_effect(rollout_id, attempt_id, self.harness.verify(task))
        if verdict == "superseded":
            return None
        if failure is not None:
            return failure
        if any(r.attempt_id == attempt_id for r in self.store.list_rewards(rollout_ids=[rollout_id])):
            return Outcome(AttemptState.succeeded, "ok")
        if self.harness.judge is None:
            return Outcome(AttemptState.succeeded, "no_reward", "harness finished without posting a reward")
        return self._judge(task, attempt_id, env)

    def _judge(self, task: dict, attempt_id: str, env: dict[str, str]) -> Outcome:
        """Score an attempt that posted no reward with the harness's judge, posted through the gateway."""
        try:
            calls = transcript(self.store, attempt_id, self.decode)
            value = reward_value(self.harness.judge(task, calls), f"judge {self.harness.judge_name}")
            if value is None:
                raise TypeError(f"judge {self.harness.judge_name} returned None; a judge must give a number")
            post_reward(env["AGL_EVENT_URL"], env["AGL_KEY"], value, judge=self.harness.judge_name)
        except Exception as exc:  # noqa: BLE001 - the user's judge may raise anything; it ends the attempt
            return Outcome(AttemptState.failed, "judge_error", f"{type(exc).__name__}: {exc}")
        return Outcome(AttemptState.succeeded, "ok")

    def _heartbeat(self, attempt_id: str) -> bool:
        self.store.heartbeat(attempt_id)
        return self.store.get_attempt(attempt_id).state == AttemptState.running

    def _record_effect(self, rollout_id: str, attempt_id: str, result: dict) -> None:
        span = Span(
            trace_id=attempt_id, rollout_id=rollout_id, attempt_id=attempt_id, sequence=RUNNER_SPAN_SEQUENCE,
            name="effect", kind=SpanKind.custom, end_time=time.time(),
            status="ok" if result.get("verified") else "error",
            attributes={**result, "family": "effect", "harness": self.harness.name},
        )  # fmt: skip
        self.store.add_spans([span])

    def _reap_loop(self, ids: list[str] | None, stop: threading.Event) -> None:
        interval = min(self.policy.heartbeat_timeout_s / 4, 1.0)
        while not stop.wait(interval):
            try:
                self.reap(ids)
            except Exception:  # noqa: BLE001 - try again next round rather than stop reaping
                log.exception("reaping failed")

    def reap(self, ids: list[str] | None) -> list[str]:
        """End stale running attempts (of `ids`, else this harness's) `unresponsive`; their ids."""
        cutoff = time.time() - self.policy.heartbeat_timeout_s
        scope = {"rollout_ids": ids} if ids is not None else {"harness": self.harness.name}
        reaped = []
        for attempt in self.store.stale_attempts(cutoff, **scope):
            last = attempt.heartbeat_at or attempt.started_at or 0.0
            with self._lock:
                ours = attempt.attempt_id in self._active
                self._busy += 1
            try:
                message = (
                    f"no heartbeat for {time.time() - last:.1f}s (limit {self.policy.heartbeat_timeout_s:g}s)"
                )
                try:
                    ended = self.store.transition_attempt(
                        attempt.attempt_id, AttemptState.unresponsive, reason_code="no_heartbeat",
                        reason_message=message,
                    )  # fmt: skip
                except IllegalTransition:
                    continue  # it ended while we looked
                reaped.append(attempt.attempt_id)
                if not ours:
                    self._after(ended)  # a retry is queued; any worker's claim picks it up
            finally:
                self._release()
        return reaped
