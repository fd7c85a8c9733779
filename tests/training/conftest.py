"""A tiny causal LM built from config (no tokenizer needed) for loss and trainer tests, and the loss and
trainer configs of the default settings with a test's changes."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_dagster.settings import TrainingSettings
from lightning_dagster.training import configs
from lightning_dagster.training.loss import LossConfig
from lightning_dagster.training.step import StepSettings
from lightning_dagster.training.trainer import TrainerConfig
from lightning_dagster.training.transitions import Row


def loss_config(**changes) -> LossConfig:
    """`TrainingSettings()`'s loss (`training.configs.loss_config`) with `changes`."""
    return dataclasses.replace(configs.loss_config(TrainingSettings()), **changes)


def step_settings(**changes) -> StepSettings:
    """`TrainingSettings()`'s RL step (`training.configs.step_settings`) with `changes`."""
    return dataclasses.replace(configs.step_settings(TrainingSettings()), **changes)


def trainer_config(**changes) -> TrainerConfig:
    """`TrainingSettings()`'s trainer config (`training.configs.trainer_config`) with `changes`."""
    return dataclasses.replace(configs.trainer_config(TrainingSettings()), **changes)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("tiny")
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def random_rows(seed: int, rollouts: dict[str, int]) -> list[Row]:
    """`rollouts` maps rollout id -> number of rows it became; lengths, masks and logprobs vary."""
    rng = random.Random(seed)
    rows = []
    for rid, n in rollouts.items():
        for _ in range(n):
            p, r = rng.randint(2, 9), rng.randint(3, 14)
            mask = [1 if rng.random() < 0.7 else 0 for _ in range(r)]
            mask[0] = 1
            rows.append(
                Row(
                    rollout_id=rid,
                    attempt_id="at-" + rid,
                    prompt_ids=[rng.randrange(64) for _ in range(p)],
                    response_ids=[rng.randrange(64) for _ in range(r)],
                    loss_mask=mask,
                    behaviour_logprobs=[-rng.uniform(3.5, 4.8) * m for m in mask],
                    temperature=1.0,
                    span_ids=[],
                )
            )
    return rows


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory) -> Path:
    """The embedded engine's real base model (tokenizer + chat template + tiny Qwen2), built once."""
    from lightning_dagster.engine.build import build_base_model
    from lightning_dagster.harnesses.corpus import training_corpus

    return build_base_model(tmp_path_factory.mktemp("base"), corpus=training_corpus(seed=0), seed=0)
