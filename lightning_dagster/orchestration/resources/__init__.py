"""Dagster resources: small typed settings, each readable from an environment variable, with working defaults.

Every field left at its default falls back to the embedded default of `lightning_dagster.paths` (which reads
`LD_STORE_URL`, `MLFLOW_TRACKING_URI`, ...), so `dagster dev -w workspace.yaml` works with no setup. The
resources only hold settings and hand out core objects; they contain no pipeline logic.
"""

from __future__ import annotations

import os

import dagster as dg
from pydantic import PrivateAttr

from lightning_dagster import paths


def _env_or(name: str, default: str, *, deferred: bool = True) -> dg.EnvVar | str:
    """`dg.EnvVar(name)` when the variable is set (the UI then shows where the value came from), else the
    default. `deferred=False` reads the value now, for code that uses the resources outside a Dagster run
    (the demo, the benchmark), where an `EnvVar` is never resolved."""
    if not os.environ.get(name):
        return default
    return dg.EnvVar(name) if deferred else os.environ[name]


class StoreResource(dg.ConfigurableResource):
    """The durable store (rollouts, attempts, spans, receipts, pointers). Empty url: `$LD_STORE_URL` or SQLite."""

    url: str = ""
    _store: object = PrivateAttr(default=None)

    def resolved_url(self) -> str:
        return self.url or paths.store_url()

    def get(self):
        # One Store (one SQLAlchemy engine) per process: each asset op re-uses the connection pool.
        if self._store is None:
            from lightning_dagster.store import Store

            self._store = Store(self.resolved_url())
        return self._store


class MLflowResource(dg.ConfigurableResource):
    """Where candidate lineage and the two pointers live. Empty tracking_uri: `$MLFLOW_TRACKING_URI` or SQLite."""

    tracking_uri: str = ""
    model_name: str = "lightning-dagster-policy"
    ui_url: str = ""  # e.g. http://127.0.0.1:5000, to turn run ids into links in asset metadata

    def resolved_uri(self) -> str:
        return self.tracking_uri or paths.mlflow_tracking_uri()


class PolicyModelResource(dg.ConfigurableResource):
    """The policy being trained and what serves it: the embedded engine, or an upstream OpenAI-compatible
    server (then nothing can push trained weights to it: RL needs the embedded engine)."""

    # a user project (its `lightning-dagster.yaml` or the folder holding it): the pipeline runs its harness on
    # its tasks file; empty: the built-in harness named by `harness`
    project: str = ""
    # the built-in harness whose generated tasks the pipeline samples, trains and evaluates on when no
    # project is given (`examples/NAME`)
    harness: str = "calc"
    # torch threads of the embedded engine that serves rollouts (`LocalGateway(threads=)`). One: the harness
    # workers' process runs beside it, and two OpenMP threads then spin against it (on 2 cores the rollout
    # path ran 14 rollouts/s at two threads, 19 at one: benchmarks/README.md, rollout path)
    engine_threads: int = 1
    # where the embedded engine runs: auto (CUDA when present, bf16 autocast; else CPU), cpu, cuda, cuda:N
    engine_device: str = "auto"
    # the most sequences the embedded engine decodes at once (`LocalGateway(max_batch=)`)
    max_batch: int = 64
    # the embedded engine in a process of its own (token ids in, tokens and logprobs out; `LocalGateway(
    # engine_process=)`): its decode loop then has an interpreter lock to itself instead of sharing the
    # gateway's with the HTTP server and the span writers, which took it back at every torch call of a
    # forward and doubled a decode step's cost (benchmarks/README.md, rollout path); false: a thread of the
    # gateway's process (one process fewer to start)
    engine_process: bool = True
    # e.g. a vLLM server, or several comma-separated (each rollout sticks to one, failing over when it is
    # down): the gateway forwards every call there instead of to the embedded engine; empty: the embedded
    # engine serves (`LocalGateway(upstream_url=)`)
    upstream_url: str = ""
    # seed of the base model built from scratch and of the first parent's warm start (pipeline.bootstrap)
    seed: int = 0


class GatewayResource(dg.ConfigurableResource):
    """The OpenAI-compatible gateway the harnesses call, and the runner that starts them."""

    # address the local gateway binds (loopback by default: attempt keys travel in clear HTTP)
    host: str = "127.0.0.1"
    # its port; 0: a free port per run
    port: int = 0
    # the attempt-key signing secret; empty (the default): a fresh random secret per run, held in memory
    # only (attempt keys then die with the run). Never read from the environment, where a harness could
    # read it in /proc/PID/environ, and better left empty under Dagster, which stores and shows run config.
    secret: str = ""
    # "inprocess": harness attempts run as threads of the asset's process; "subprocess": each attempt is a
    # child process (the harness's command line), killed on timeout or cancel
    runner_mode: str = "inprocess"
    # "bwrap": each subprocess attempt runs under bubblewrap in a PID namespace of its own, away from the
    # gateway's /proc and the lightning-dagster home (needs runner_mode "subprocess"; docs/SECURITY.md)
    sandbox: str = "none"
    # harness attempts the runner runs at once; 0 (auto): twice `model.max_batch` for in-process attempts
    # (each has at most one call in flight, and the spare attempts fill the rows of those in their own turn
    # between calls, so the engine's batch stays full: benchmarks/README.md, rollout path), `model.max_batch`
    # for subprocess ones (each a process of its own)
    parallel: int = 0


class TrainingResource(dg.ConfigurableResource):
    """RL settings: the one source of the demo's, the CLI's and the code location's (`lightning-dagster demo`
    runs these defaults), so the same evaluator fingerprints the same everywhere. The closed-set sizes meet the
    default policy's minimums (held-out `min_n` 100); `update_plan` warns when a plan cannot pass its policy."""

    # 8 steps of 8 tasks x group 16 at lr 1e-4 (with KL, selection and early stop below): promoted on 3 of 3
    # seeds at +0.14..+0.20 in ~3 minutes a cycle on 2 cores; 16 steps x 16 tasks promoted too, at +0.45,
    # in ~8 minutes (benchmarks/README.md, release cycles on 3 seeds).
    group_size: int = 16  # rollouts per task (one GRPO group)
    steps: int = 8  # RL steps, one optimizer update each
    tasks_per_step: int = 8  # train tasks sampled per step (x group_size rollouts)
    learning_rate: float = 1e-4
    temperature: float = 1.0  # sampling temperature of every call of a train rollout (Rollout.sampling)
    holdout_tasks: int = 128  # held-out tasks the parent and the candidate are compared on
    protected_tasks: int = 32  # cases decoded greedily that must not regress
    canary_tasks: int = 8  # tasks of the bounded canary
    eval_seed: int = 1234  # one sampling seed for parent and candidate (common random numbers)
    # attempts per rollout and seconds per attempt (the runner's RetryPolicy, fingerprinted into the receipt);
    # None: the harness's own (a project's `harness.max_attempts` / `timeout_s`; the examples: 1 attempt,
    # which keeps a failed sample a failed sample, as RL needs, and 120 s)
    max_attempts: int | None = None
    attempt_timeout_s: float | None = None
    advantage: str = "grpo"  # rollout-level advantage mode (training.advantages)
    # A rollout with an invalid span (NaN/inf/positive logprobs, negative ids, an empty prompt, no finite
    # temperature) is left out of its step, named in the step's metadata; more than this share of a step's
    # rollouts left out, or none left, fails the step (training.transitions.TooManyExcludedRollouts).
    max_excluded_rollouts: float = 0.1
    # how per-token losses are weighted (training.loss): token_mean, seq_mean_token_mean (per rollout), or
    # constant (Dr. GRPO's fixed denominator, `loss_constant`, e.g. the token budget of a step)
    loss_normalization: str = "token_mean"
    loss_constant: float | None = None
    # weight of the k3 KL to the exact parent in the RL loss (a frozen copy of the parent scores the sampled
    # tokens; training.loss): keeps the parent's greedy behaviour while RL lifts sampled success; 0: off
    kl_coef: float = 0.1
    # Checkpoint selection (training.selection): every `validation_every` steps and at the last, the
    # candidate is decoded greedily on `validation_tasks` train-split tasks it does not train on; the
    # proposed checkpoint is the best one that keeps every validation case the parent solved. 0 tasks: the
    # last checkpoint, as without selection.
    validation_tasks: int = 64
    validation_every: int = 2
    # evaluations in a row that regressed (lost a parent-solved case or fell below the best so far) before
    # training stops early; 0: never. The receipt records the stop with the evaluations behind it, and
    # check 2 expects only the train rollouts of the steps that ran once it has recomputed the stop.
    validation_patience: int = 2
    # The first parent's supervised warm start (training.warmstart): stops once sampled success enters
    # the window (at its target), or after `warm_start_max_steps`.
    warm_start_max_steps: int = 300
    warm_start_probe_tasks: int = 64  # tasks of the sampled probe that decides when to stop
    warm_start_demos: int = 2000  # demonstrations the warm start trains on
    min_serve_rollouts: int = 32  # new rewarded serve rollouts that justify a new snapshot
    success_threshold: float = 0.5  # a task counts as solved (protected cases) at or above this reward
    # training processes of `candidate_resource` (DistributedDataParallel ranks under torch.distributed.run,
    # launched through the `trainer_pipes` client; training.distributed)
    nproc: int = 1
    # where the trainer runs: auto (CUDA when present, bf16 autocast; else CPU), cpu, cuda
    device: str = "auto"


class GateResource(dg.ConfigurableResource):
    """The versioned release policy and who approves. Empty paths: the gate's and registry's own defaults."""

    policy_path: str = ""
    roles_path: str = ""
    evaluator: str = "heldout-sampled-success"
    evaluator_version: str = "1"
    scope: str = "bounded-canary"
    canary_approver_roles: list[str] = ["release-owner"]
    default_approver_roles: list[str] = ["default-approver"]
    # The canary needs an effect it can re-read at its destination; `calc` has none, so the ledger workflow.
    canary_harness: str = "ledger"
    canary_denied_tools: list[str] = ["delete_account"]
    canary_max_seconds: float = 300.0
    canary_max_cost: float = 0.0  # the embedded engine costs nothing per token
    infrastructure_retry_budget: int = 0


class PipelineResource(dg.ConfigurableResource):
    """All settings of one pipeline run, nested, so every asset takes one resource and tests swap one object."""

    store: StoreResource
    mlflow: MLflowResource
    model: PolicyModelResource
    gateway: GatewayResource
    training: TrainingResource
    gate: GateResource

    def get_store(self):
        return self.store.get()


def default_pipeline(*, deferred: bool = True, **overrides: dg.ConfigurableResource) -> PipelineResource:
    """The code location's pipeline resource, each part overridable by its environment variable; tests pass
    `training=TrainingResource(steps=1, ...)` and the like. A gateway secret in the environment
    (`LD_GATEWAY_SECRET`, `LD_ADMIN_KEY`) raises `SecretError`: harnesses could read it there."""
    from lightning_dagster.gateway.keys import refuse_env_secrets

    refuse_env_secrets()

    def env_or(name: str, default: str) -> dg.EnvVar | str:
        return _env_or(name, default, deferred=deferred)

    parts: dict[str, dg.ConfigurableResource] = {
        "store": StoreResource(url=env_or("LD_STORE_URL", "")),
        "mlflow": MLflowResource(
            tracking_uri=env_or("MLFLOW_TRACKING_URI", ""), ui_url=env_or("LD_MLFLOW_UI_URL", "")
        ),
        "model": PolicyModelResource(
            project=env_or("LD_PROJECT", ""),
            harness=env_or("LD_HARNESS", "calc"),
            upstream_url=env_or("LD_UPSTREAM_URL", ""),
        ),
        "gateway": GatewayResource(),
        "training": TrainingResource(),
        "gate": GateResource(
            policy_path=env_or("LD_GATE_POLICY", ""), roles_path=env_or("LD_ROLES_FILE", "")
        ),
    }
    parts.update(overrides)
    return PipelineResource(**parts)
