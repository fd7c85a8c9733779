"""The RL loop through the real runner and gateway (embedded engine, SQLite store): rows come from the
recorded spans, token-in makes every attempt one row, evaluation seeds give common random numbers, one RL
step samples with its seed and temperature, the trainer's new weights reach the engine that serves the
next step, and `train_rl` runs the steps, the selection and the evaluations its pools ask for."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lightning_dagster.project.examples import example_tasks
from lightning_dagster.runner import sampling_seed
from lightning_dagster.runner.service import RolloutService
from lightning_dagster.settings import ServingSettings, TrainingSettings
from lightning_dagster.store import Store
from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.loop import FirstBatch, Pools, draw_pools, train_rl
from lightning_dagster.training.step import rl_step, rows_and_rewards, step_seed
from lightning_dagster.training.trainer import Trainer
from lightning_dagster.types import RolloutKind, Sampling, SpanKind
from tests.training.conftest import random_rows, step_settings, trainer_config

T1 = Sampling(temperature=1.0)

SERVING = ServingSettings(parallel=8, engine_process=False)


def test_rollouts_through_gateway_merge_into_one_row_each(tmp_path, base_model_dir):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    with RolloutService(store, base_model_dir, harness="calc", serving=SERVING) as svc:
        tasks = example_tasks("calc").draw("train", 3, 0)
        batch = svc.run(tasks, group=2, kind=RolloutKind.train, sampling=T1, seed=5, tag="t")
        assert len(batch.rollouts) == 6 and len(batch.rewards) == 6
        assert all(store.get_rollout(r.rollout_id).sampling() == T1 for r in batch.rollouts)
        rows, rewards, merge = rows_and_rewards(batch, step_settings())
        assert len(rewards) == 6 and {r.group_id for r in rewards} == {"t-g0", "t-g1", "t-g2"}
        assert merge["merge_attempts"] == 6 and merge["merge_mismatches"] == 0
        # token-in: one row per attempt, plus one for each call after a response cut off at `length`
        assert merge["merge_rows"] == 6 + merge["merge_length_splits"]
        for row in rows:
            assert row.trained_tokens > 0 and len(row.behaviour_logprobs) == len(row.response_ids)

        # common random numbers: the same weights and the same evaluation seed give the same outcomes
        heldout = example_tasks("calc").draw("holdout", 8, 0)
        first = svc.run(heldout, group=1, kind=RolloutKind.holdout, sampling=T1, seed=9, tag="e1")
        again = svc.run(heldout, group=1, kind=RolloutKind.holdout, sampling=T1, seed=9, tag="e2")
        tokens = [[s.response_token_ids for s in first.spans[r.rollout_id]] for r in first.rollouts]
        tokens2 = [[s.response_token_ids for s in again.spans[r.rollout_id]] for r in again.rollouts]
        assert tokens == tokens2

        # new weights reach the serving engine: all-zero weights make every next token equally likely
        zeroed = {k: torch.zeros_like(v) for k, v in svc.codec.model.state_dict().items()}
        svc.load_weights(zeroed, "res-zero")
        after = svc.run(heldout[:2], group=1, kind=RolloutKind.holdout, sampling=T1, seed=9, tag="e3")
        llm = [s for spans in after.spans.values() for s in spans if s.kind == SpanKind.llm]
        assert llm and {s.resource_id for s in llm} == {"res-zero"}
        assert {r.resource_id for r in after.rollouts} == {"res-zero"}
        uniform = -math.log(svc.codec.vocab_size)
        assert all(lp == pytest.approx(uniform, abs=1e-4) for s in llm for lp in s.response_logprobs)


def test_one_rl_step_samples_with_its_seed_and_temperature_and_serves_the_update(tmp_path, base_model_dir):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    settings = step_settings(group_size=3, temperature=0.7)
    trainer = Trainer(base_model_dir, trainer_config(lr=1e-3))
    with RolloutService(store, base_model_dir, harness="calc", serving=SERVING) as svc:
        tasks = example_tasks("calc").draw("train", 2, 0)
        batch, metrics = rl_step(
            svc, trainer, tasks, step=3, settings=settings, base_seed=7, tag="s3", resource_id="cand@3"
        )
        assert len(batch.rollouts) == 6 and {r.group_id for r in batch.rollouts} == {"s3-g0", "s3-g1"}
        for r in batch.rollouts:
            stored = store.get_rollout(r.rollout_id)
            assert stored.sampling() == Sampling(temperature=0.7)
            assert stored.kind == RolloutKind.train
        seeds = [store.get_rollout(r.rollout_id).metadata["sampling_seed"] for r in batch.rollouts]
        assert seeds == [sampling_seed(step_seed(7, 3), t["task_id"], i) for t in tasks for i in range(3)]
        assert len(set(seeds)) == 6
        assert metrics["success"] == batch.success() and metrics["merge_attempts"] == len(
            batch.rewards.keys() & batch.spans.keys()
        )
        # the trainer's update is what serves now, under the new resource id
        served = svc.codec.model.state_dict()
        assert all(torch.equal(served[k], v) for k, v in trainer.state_dict().items())
        assert svc.resource_id == "cand@3"


def test_greedy_evaluation_ignores_the_sampling_seed(tmp_path, base_model_dir):
    """Needs the gateway to apply each rollout's `Sampling` (temperature 0 here) to every call."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    greedy = Sampling(temperature=0.0)
    with RolloutService(store, base_model_dir, harness="calc", serving=SERVING) as svc:
        heldout = example_tasks("calc").draw("holdout", 4, 0)
        a = svc.run(heldout, group=1, kind=RolloutKind.holdout, sampling=greedy, seed=1, tag="g1")
        b = svc.run(heldout, group=1, kind=RolloutKind.holdout, sampling=greedy, seed=2, tag="g2")
    tokens = [[s.response_token_ids for s in a.spans[r.rollout_id]] for r in a.rollouts]
    tokens2 = [[s.response_token_ids for s in b.spans[r.rollout_id]] for r in b.rollouts]
    assert tokens == tokens2


def test_train_rl_runs_steps_and_reports_metrics(tmp_path, base_model_dir):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    t = TrainingSettings(steps=2, tasks_per_step=2, group_size=4, holdout_tasks=6, eval_every=2,
                         validation_tasks=3, validation_every=1, validation_patience=0)  # fmt: skip
    result = train_rl(
        base_model_dir,
        t,
        draw_pools(example_tasks("calc"), t),
        lambda: RolloutService(store, base_model_dir, harness="calc", serving=SERVING),
        base_seed=t.seed,
        out_dir=tmp_path / "cand",
    )
    assert [p["step"] for p in result.curve] == [0, 2]
    assert "greedy" in result.parent and "greedy" in result.candidate
    assert len(result.steps) == 2 and all("merge_mismatch_rate" in m for m in result.steps)
    assert (result.checkpoint / "config.json").exists() and (result.checkpoint / "tokenizer.json").exists()
    train = store.query_rollouts(kind=RolloutKind.train)
    assert len(train) == 2 * 2 * 4
    assert {r.group_id for r in train} == {f"rl-s{s}-g{t}" for s in (1, 2) for t in (0, 1)}
    # the final evaluation's sampled success is the mean reward of its held-out rollouts
    final = [
        r
        for r in store.query_rollouts(kind=RolloutKind.holdout)
        if re.fullmatch(r"rl-eval2-g\d+", r.group_id)
    ]
    rewards = {
        rw.rollout_id: rw.value for rw in store.list_rewards(rollout_ids=[r.rollout_id for r in final])
    }
    assert len(final) == 6 and result.candidate["success"] == pytest.approx(sum(rewards.values()) / 6)
    # both checkpoints judged greedily on 3 train tasks the run does not train on; the proposed one is saved
    selection = result.selection
    assert [c["step"] for c in selection["checkpoints"]] == [1, 2] and selection["validation_tasks"] == 3
    assert selection["kl_coef"] == t.kl_coef and selection["chosen_step"] in (1, 2)
    assert [m["step"] for m in result.steps if "validation_success" in m] == [1, 2]
    validated = store.query_rollouts(kind=RolloutKind.validation)
    assert len(validated) == 3 * 3 and all(r.sampling() == Sampling(temperature=0.0) for r in validated)
    assert not {r.task_id for r in validated} & {r.task_id for r in train}


def test_a_run_whose_one_step_was_sampled_before_it_starts_no_service(tiny_model_dir, tmp_path):
    """The pipeline's case with one step and no validation: step 1 trains on the given batch, and with
    nothing left to sample or evaluate no gateway is started; the saved weights are that one update's."""
    rows = random_rows(3, {"a": 1, "b": 2, "c": 1, "d": 1})
    rewards = [RolloutReward(r, "g", v) for r, v in zip("abcd", (1.0, 0.0, 1.0, 0.0), strict=True)]
    first = FirstBatch(rows, compute_advantages(rewards, "grpo"), {"merge_excluded_rollouts": 0})
    t = TrainingSettings(steps=1, validation_tasks=0, device="cpu")
    logged: list[dict] = []

    def no_service():
        raise AssertionError("nothing to sample or evaluate: no service may start")

    result = train_rl(tiny_model_dir, t, Pools(train=[]), no_service, base_seed=0, first=first,
                      out_dir=tmp_path / "cand", log=logged.append)  # fmt: skip
    assert result.parent is None and result.curve == [] and logged == result.steps
    (step,) = result.steps
    assert step["merge_excluded_rollouts"] == 0 and step["trained_rows"] == len(rows)
    assert result.selection == {"kl_coef": t.kl_coef, "steps_run": 1, "validation_tasks": 0, "chosen_step": 1,
                                "early_stop": None}  # fmt: skip
    expected = Trainer(tiny_model_dir, trainer_config(device="cpu"))
    expected.step(first.rows, first.advantages)
    saved = Trainer(result.checkpoint, trainer_config(device="cpu")).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in expected.state_dict().items())
