"""One trainer step: metrics per step, weights move only where there is signal, checkpoint round-trips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.trainer import Trainer, load_model
from tests.training.conftest import loss_config, random_rows, trainer_config

METRICS = {"loss", "reward_mean", "kl", "clip_fraction", "is_ratio_mean", "is_ratio_max", "tokens_per_s",
           "grad_norm", "skipped_groups", "trained_rows"}  # fmt: skip


def test_step_with_kl_and_two_epochs_reports_metrics_and_saves(tiny_model_dir, tmp_path):
    rows = random_rows(4, {"a": 2, "b": 1, "c": 1, "d": 1})
    adv = compute_advantages([RolloutReward(r, "g", float(r in "ab")) for r in "abcd"], "grpo")
    config = trainer_config(lr=1e-2, epochs=2, loss=loss_config(kl_coef=0.1, clip_low=0.05, clip_high=0.05))
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
    trainer = Trainer(tiny_model_dir, trainer_config())
    before = trainer.state_dict()
    m = trainer.step(rows, adv)
    assert m["trained_rows"] == 0 and m["skipped_groups"] == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())


def test_supervised_step_lowers_the_nll_of_its_tokens(tiny_model_dir):
    rows = random_rows(6, {"demo": 4})
    trainer = Trainer(tiny_model_dir, trainer_config(lr=1e-2))
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
    trainer = Trainer(tiny_model_dir, trainer_config(threads=3))
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
    trainer = Trainer(tiny_model_dir, trainer_config())
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


def _two_rollouts():
    rows = random_rows(11, {"a": 1, "b": 1})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 0.0)], "grpo")
    return rows, adv


def _spoil(row, how: str) -> None:
    if how == "id_past_vocab":
        row.response_ids[0] = 64
    elif how == "negative_id":
        row.prompt_ids[0] = -1
    elif how == "empty_prompt":
        row.prompt_ids = []
    elif how == "short_mask":  # a one-element mask broadcast over the whole response before
        row.loss_mask = [1]
    elif how == "short_logprobs":
        row.behaviour_logprobs = [-1.0]
    elif how == "nan_logprob":
        row.behaviour_logprobs[0] = float("nan")
    elif how == "longer_than_positions":
        row.prompt_ids = [1] * 200  # the tiny model has 128 positions
    elif how == "nan_temperature":
        row.temperature = float("nan")  # was scored at 1.0 without a word


SPOILS = ["id_past_vocab", "negative_id", "empty_prompt", "short_mask", "short_logprobs", "nan_logprob",
          "longer_than_positions", "nan_temperature"]  # fmt: skip


@pytest.mark.parametrize("how", SPOILS)
def test_rows_the_model_cannot_score_are_refused_before_any_change(tiny_model_dir, how):
    from lightning_dagster.training.trainer import InvalidRows

    rows, adv = _two_rollouts()
    _spoil(rows[1], how)
    trainer = Trainer(tiny_model_dir, trainer_config(lr=1e-2))
    before = trainer.state_dict()
    with pytest.raises(InvalidRows, match="rollout b"):
        trainer.step(rows, adv)
    with pytest.raises(InvalidRows, match="rollout b"):
        trainer.supervised_step(rows)
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())


def test_a_non_finite_loss_takes_no_optimizer_step(tiny_model_dir, tmp_path):
    """A NaN advantage (or anything else that makes the loss NaN) used to reach Adam and turn every
    weight into NaN; the step now raises and leaves the weights as they were, still savable."""
    from lightning_dagster.training.advantages import Advantages
    from lightning_dagster.training.trainer import NonFiniteUpdate

    rows, _ = _two_rollouts()
    trainer = Trainer(tiny_model_dir, trainer_config(lr=1e-2))
    before = trainer.state_dict()
    with pytest.raises(NonFiniteUpdate):
        trainer.step(rows, Advantages(values={"a": float("nan"), "b": 0.5}))
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())
    assert all(p.grad is None for p in trainer.model.parameters())
    load_model(trainer.save(tmp_path / "ckpt"))


def test_a_supervised_step_without_trained_tokens_is_refused(tiny_model_dir):
    from lightning_dagster.training.trainer import InvalidRows

    rows = random_rows(12, {"demo": 2})
    for r in rows:
        r.loss_mask = [0] * len(r.response_ids)
    trainer = Trainer(tiny_model_dir, trainer_config(lr=1e-2))
    before = trainer.state_dict()
    with pytest.raises(InvalidRows, match="no trained token"):
        trainer.supervised_step(rows)
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": float("nan")}, {"lr": -1e-4}, {"lr": float("inf")}, {"grad_clip": float("nan")},
     {"grad_clip": 0.0}, {"epochs": 0}, {"micro_batch_tokens": 0}, {"betas": (0.9, 1.0)},
     {"weight_decay": float("nan")}],
)  # fmt: skip
def test_unusable_trainer_settings_are_a_named_error(kwargs):
    from lightning_dagster.training.trainer import TrainerConfigError

    with pytest.raises(TrainerConfigError, match=next(iter(kwargs))):
        trainer_config(**kwargs)


def test_save_refuses_non_finite_weights(tiny_model_dir, tmp_path):
    from lightning_dagster.training.trainer import NonFiniteWeights

    trainer = Trainer(tiny_model_dir, trainer_config())
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeights):
        trainer.save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_save_that_fails_part_way_leaves_no_half_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """Disk full while writing the weights: before, `out_dir` kept a config.json, tokenizer files and a
    truncated weights file; now it is absent (or, when it held a checkpoint, still holds that one)."""
    trainer = Trainer(tiny_model_dir, trainer_config(lr=1e-2))
    good = trainer.save(tmp_path / "ckpt")
    real = type(trainer.model).save_pretrained

    def disk_full(self, out, *args, **kwargs):
        real(self, out, *args, **kwargs)
        (Path(out) / "model.safetensors").write_bytes(b"\0" * 10)  # truncated
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(trainer.model), "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space"):
        trainer.save(tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(OSError, match="No space"):
        trainer.save(good)
    load_model(good)  # the earlier checkpoint is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial directory left behind
