"""The settings every stage reads, as structural types: the Dagster `PipelineResource` satisfies them without
the core `pipeline` package importing Dagster (tests and scripts may pass any object of this shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lightning_dagster.store import Store


class MLflowSettings(Protocol):
    model_name: str
    ui_url: str

    def resolved_uri(self) -> str: ...


class ModelSettings(Protocol):
    project: str
    harness: str
    engine_threads: int
    engine_device: str
    max_batch: int
    engine_process: bool
    upstream_url: str
    seed: int


class GatewaySettings(Protocol):
    host: str
    port: int
    secret: str
    runner_mode: str
    sandbox: str
    parallel: int


class TrainingSettings(Protocol):
    group_size: int
    steps: int
    tasks_per_step: int
    learning_rate: float
    temperature: float
    holdout_tasks: int
    protected_tasks: int
    canary_tasks: int
    eval_seed: int
    max_attempts: int | None
    attempt_timeout_s: float | None
    advantage: str
    max_excluded_rollouts: float
    loss_normalization: str
    loss_constant: float | None
    kl_coef: float
    validation_tasks: int
    validation_every: int
    validation_patience: int
    warm_start_max_steps: int
    warm_start_probe_tasks: int
    warm_start_demos: int
    min_serve_rollouts: int
    success_threshold: float
    nproc: int
    device: str


class GateSettings(Protocol):
    policy_path: str
    roles_path: str
    evaluator: str
    evaluator_version: str
    scope: str
    canary_approver_roles: list[str]
    default_approver_roles: list[str]
    canary_harness: str
    canary_denied_tools: list[str]
    canary_max_seconds: float
    canary_max_cost: float
    infrastructure_retry_budget: int


class Pipeline(Protocol):
    """One pipeline run's settings, nested as in `lightning_dagster.orchestration.resources.PipelineResource`."""

    model: ModelSettings
    mlflow: MLflowSettings
    gateway: GatewaySettings
    training: TrainingSettings
    gate: GateSettings

    def get_store(self) -> Store: ...
