"""One trainer step: metrics per step, weights move only where there is signal, checkpoint round-trips."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.loss import LossConfig
from lightning_dagster.training.trainer import Trainer, TrainerConfig, load_model
from tests.training.conftest import random_rows

METRICS = {"loss", "reward_mean", "kl", "clip_fraction", "is_ratio_mean", "is_ratio_max", "tokens_per_s",
           "grad_norm", "skipped_groups", "trained_rows"}  # fmt: skip


def test_step_with_kl_and_two_epochs_reports_metrics_and_saves(tiny_model_dir, tmp_path):
    rows = random_rows(4, {"a": 2, "b": 1, "c": 1, "d": 1})
    adv = compute_advantages([RolloutReward(r, "g", float(r in "ab")) for r in "abcd"], "grpo")
    config = TrainerConfig(lr=1e-2, epochs=2, loss=LossConfig(kl_coef=0.1, clip_low=0.05, clip_high=0.05))
    trainer = Trainer(tiny_model_dir, config)
    before = trainer.state_dict()
    m = trainer.step(rows, adv, extra={"merge_mismatch_rate": 0.0})
    assert METRICS <= m.keys() and m["trained_rows"] == 5 and m["merge_mismatch_rate"] == 0.0
    assert m["kl"] > 0 and m["clip_fraction"] > 0  # the second epoch moved away from the parent and clipped
    assert any(not torch.equal(before[k], v) for k, v in trainer.state_dict().items())
    out = trainer.save(tmp_path / "ckpt")
    reloaded = load_model(out).state_dict()
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(reloaded[k], v), k


def test_step_without_signal_leaves_weights_untouched(tiny_model_dir):
    rows = random_rows(5, {"a": 1, "b": 1})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 1.0)], "grpo")
    trainer = Trainer(tiny_model_dir, TrainerConfig())
    before = trainer.state_dict()
    m = trainer.step(rows, adv)
    assert m["trained_rows"] == 0 and m["skipped_groups"] == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())


def test_supervised_step_lowers_the_nll_of_its_tokens(tiny_model_dir):
    rows = random_rows(6, {"demo": 4})
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=1e-2))
    first = trainer.supervised_step(rows)["nll"]
    for _ in range(5):
        last = trainer.supervised_step(rows)["nll"]
    assert last < first - 0.1
    assert first == pytest.approx(4.2, abs=0.5)  # ~log(64) from a random init


def test_steps_use_their_own_thread_count_and_restore_the_process_setting(tiny_model_dir, monkeypatch):
    """An engine in the same process sets torch to 1 thread for sampling; a trainer step must not inherit
    that (it ran 1.6x slower), nor leave its own setting behind for the engine."""
    seen: list[int] = []
    rows = random_rows(7, {"a": 1, "b": 1})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 0.0)], "grpo")
    trainer = Trainer(tiny_model_dir, TrainerConfig(threads=3))
    original = trainer.backward
    monkeypatch.setattr(
        trainer, "backward", lambda prep: (seen.append(torch.get_num_threads()), original(prep))[1]
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.step(rows, adv)
        assert seen == [3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_without_a_thread_count_a_step_takes_ld_trainer_threads(tiny_model_dir, monkeypatch):
    seen: list[int] = []
    rows = random_rows(7, {"a": 1, "b": 1})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 0.0)], "grpo")
    trainer = Trainer(tiny_model_dir, TrainerConfig())
    original = trainer.backward
    monkeypatch.setattr(
        trainer, "backward", lambda prep: (seen.append(torch.get_num_threads()), original(prep))[1]
    )
    before = torch.get_num_threads()
    try:
        for value in ("1", "2"):
            monkeypatch.setenv("LD_TRAINER_THREADS", value)
            trainer.step(rows, adv)
        monkeypatch.delenv("LD_TRAINER_THREADS")
        trainer.step(rows, adv)  # one per core
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, max(1, os.cpu_count() or 1)]
