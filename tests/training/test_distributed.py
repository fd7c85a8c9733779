"""Data-parallel training: 2 gloo ranks under DistributedDataParallel make the same update as one process on
the same batch, for every loss normalization, and rank 0 writes the checkpoint one process would."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from lightning_dagster.engine.build import checkpoint_hash
from lightning_dagster.training import distributed
from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.loss import LossConfig
from lightning_dagster.training.trainer import Trainer, TrainerConfig
from tests.training.conftest import loss_config, random_rows, trainer_config

# rollout -> rows it became: "a" was split into 3 rows, so per-rollout weighing differs from per-row
ROLLOUTS = {"a": 3, "b": 1, "c": 2, "d": 1, "e": 1}
REWARDS = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 0.5}
LOSSES = {
    "token_mean": loss_config(normalization="token_mean", kl_coef=0.1),
    "seq_mean_token_mean": loss_config(normalization="seq_mean_token_mean", kl_coef=0.1),
    "constant": loss_config(normalization="constant", constant=40.0, kl_coef=0.1),
}
# two rollouts, one row each: every rank backpropagates exactly one row, as one process does row by row
HASH_ROLLOUTS = {"p": 1, "q": 1}


def config(loss: LossConfig) -> TrainerConfig:
    # micro_batch_tokens=1: one row per micro-batch, so micro-batching and no_sync accumulation are exercised;
    # two epochs: the second scores against moved weights, so the KL to the frozen parent is live
    return trainer_config(lr=1e-2, epochs=2, micro_batch_tokens=1, threads=1, device="cpu", loss=loss)


def batch(rollouts: dict[str, int], rewards: dict[str, float]):
    rows = random_rows(11, rollouts)
    return rows, compute_advantages([RolloutReward(r, "g", rewards[r]) for r in rollouts], "grpo")


def run_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    group = distributed.join(torch.device("cpu"))
    cases = [(mode, loss, ROLLOUTS, REWARDS) for mode, loss in LOSSES.items()]
    cases.append(("hash", loss_config(kl_coef=0.1), HASH_ROLLOUTS, {"p": 1.0, "q": 0.0}))
    for name, loss, rollouts, rewards in cases:
        trainer = Trainer(model_dir, config(loss), group=group)
        if group.leader:
            metrics = trainer.step(*batch(rollouts, rewards))
            distributed.release(group)
            Path(out, f"{name}.json").write_text(json.dumps(metrics))
            if name == "hash":
                trainer.save(Path(out, "hash-ckpt"))
        else:
            assert distributed.follow(trainer) == 1
        torch.save(trainer.state_dict(), Path(out, f"{name}-rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    # spawn, not fork: a child forked from this multi-threaded test process (MLflow, Dagster and engine
    # threads of earlier tests) can inherit a lock some thread held and hang at exit (seen: one rank done,
    # the other waiting on a futex forever)
    mp.start_processes(
        run_rank, args=(2, free_port(), str(tiny_model_dir), str(out)), nprocs=2, start_method="spawn"
    )
    return out


@pytest.mark.parametrize("mode", list(LOSSES))
def test_two_gloo_ranks_update_like_one_process(mode, two_ranks, tiny_model_dir):
    single = Trainer(tiny_model_dir, config(LOSSES[mode]))
    before = single.state_dict()
    expected = single.step(*batch(ROLLOUTS, REWARDS))
    after = single.state_dict()
    rank0 = torch.load(two_ranks / f"{mode}-rank0.pt")
    rank1 = torch.load(two_ranks / f"{mode}-rank1.pt")
    for name, value in after.items():
        assert not torch.equal(value, before[name]) or name.endswith("rotary_emb.inv_freq"), name
        # Adam divides by the gradient RMS, which amplifies float rounding on tiny gradients to ~1e-6 here
        torch.testing.assert_close(rank0[name], value, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(rank0[name], rank1[name]), name  # DDP leaves every rank with the same weights
    got = json.loads((two_ranks / f"{mode}.json").read_text())
    for key in ("trained_rows", "trained_tokens", "rows"):
        assert got[key] == expected[key], key
    for key in ("loss", "kl", "grad_norm", "is_ratio_mean", "is_ratio_max", "clip_fraction"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key


def test_rank_zero_checkpoint_has_the_single_process_hash(two_ranks, tiny_model_dir, tmp_path):
    single = Trainer(tiny_model_dir, config(loss_config(kl_coef=0.1)))
    single.step(*batch(HASH_ROLLOUTS, {"p": 1.0, "q": 0.0}))
    assert checkpoint_hash(two_ranks / "hash-ckpt") == checkpoint_hash(single.save(tmp_path / "single"))


def test_follow_refuses_rank_zero(tiny_model_dir):
    trainer = Trainer(tiny_model_dir, trainer_config(device="cpu"))
    with pytest.raises(distributed.DistributedError, match="ranks 1.. of a process group"):
        distributed.follow(trainer)


def test_train_nproc_2_runs_two_ranks_and_reports_world_size(tmp_path, base_model_dir, monkeypatch, capfd):
    from lightning_dagster.cli import main

    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    argv = ["train", "--harness", "calc", "--parent", str(base_model_dir), "--steps", "1", "--group-size", "2",
            "--tasks-per-step", "2", "--holdout-tasks", "2", "--store-url", url, "--json",
            "--validation-tasks", "0", "--nproc", "2", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    (out,) = lines  # rank 0 alone prints
    result = json.loads(out)
    assert result["world_size"] == 2 and result["steps"] == 1
    assert (Path(result["checkpoint"]) / "config.json").exists()  # written by rank 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_trainer_steps_under_bf16_autocast_like_cpu(tiny_model_dir):
    cpu = Trainer(tiny_model_dir, config(LOSSES["token_mean"]))
    cuda = Trainer(tiny_model_dir, trainer_config(**{**vars(config(LOSSES["token_mean"])), "device": "cuda"}))
    expected, got = cpu.step(*batch(ROLLOUTS, REWARDS)), cuda.step(*batch(ROLLOUTS, REWARDS))
    assert cuda.device.type == "cuda" and got["trained_tokens"] == expected["trained_tokens"]
    assert got["loss"] == pytest.approx(expected["loss"], rel=0.05)  # bf16 matmuls, fp32 logprobs
