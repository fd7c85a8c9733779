"""The one place the user's settings (`TrainingSettings`, and `ServingSettings` for the warm start's probe)
become the trainer's internal configs, so those configs have no name or default of their own for a setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dagster.gateway.options import LoraSpec
from lightning_dagster.training.loss import LossConfig
from lightning_dagster.training.selection import ValidationSettings
from lightning_dagster.training.step import StepSettings
from lightning_dagster.training.trainer import TrainerConfig

if TYPE_CHECKING:
    from lightning_dagster.runner import RetryPolicy
    from lightning_dagster.runner.harness_spec import HarnessSpec
    from lightning_dagster.settings import ServingSettings, TrainingSettings
    from lightning_dagster.training.warmstart import WarmStartConfig


def step_settings(t: TrainingSettings) -> StepSettings:
    return StepSettings(
        group_size=t.group_size,
        temperature=t.temperature,
        advantage=t.advantage,
        max_excluded_share=t.max_excluded_rollouts,
    )


def loss_config(t: TrainingSettings) -> LossConfig:
    """The RL loss; `LossConfigError` when `loss_constant` does not go with the normalization."""
    return LossConfig(kl_coef=t.kl_coef, normalization=t.loss_normalization, constant=t.loss_constant)


def lora_spec(t: TrainingSettings) -> LoraSpec | None:
    """The adapter RL trains (`adapter: lora`); None: every weight trains."""
    if t.adapter != "lora":
        return None
    return LoraSpec(rank=t.lora_rank, alpha=t.lora_alpha, targets=tuple(t.lora_targets))


def trainer_config(t: TrainingSettings) -> TrainerConfig:
    return TrainerConfig(lr=t.learning_rate, device=t.device, loss=loss_config(t), lora=lora_spec(t))


def validation_settings(t: TrainingSettings) -> ValidationSettings:
    """Checkpoint selection (its success threshold is the protected cases' too)."""
    return ValidationSettings(
        tasks=t.validation_tasks,
        every=t.validation_every,
        patience=t.validation_patience,
        success_threshold=t.success_threshold,
    )


def retry_policy(t: TrainingSettings, spec: HarnessSpec) -> RetryPolicy:
    """The retry policy rollouts of `spec` run under: the harness's own unless `t` was given them."""
    given = t.given()
    overrides = {"max_attempts": given.get("max_attempts"), "timeout_s": given.get("attempt_timeout_s")}
    return spec.retry_policy(**{name: value for name, value in overrides.items() if value is not None})


def warm_start_config(
    project_file: Path | str, t: TrainingSettings, serving: ServingSettings
) -> WarmStartConfig:
    """The first parent's warm start on the project's demonstrations, its probe served as `serving` says."""
    from lightning_dagster.gateway.options import serving_settings
    from lightning_dagster.training.warmstart import WarmStartConfig

    return WarmStartConfig(
        project=str(project_file),
        seed=t.seed,
        max_steps=t.warm_start_max_steps,
        probe_tasks=t.warm_start_probe_tasks,
        demos=t.warm_start_demos,
        device=t.device,
        serving=serving_settings(serving),  # plain settings (a Dagster resource's too)
    )
