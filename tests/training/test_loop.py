"""The RL loop through the real runner and gateway (embedded engine, SQLite store): rows come from the
recorded spans, token-in makes every attempt one row, evaluation seeds give common random numbers, and the
trainer's new weights reach the engine that serves the next step."""

from __future__ import annotations

import torch

from lightning_dagster.store import Store
from lightning_dagster.training.loop import RLConfig, RolloutService, evaluate, rows_and_rewards, train_rl
from lightning_dagster.training.trainer import TrainerConfig
from lightning_dagster.types import RolloutKind


def test_rollouts_through_gateway_merge_into_one_row_each(tmp_path, base_model_dir):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    with RolloutService(store, base_model_dir, harness="calc", resource_id=None, parallel=8) as svc:
        tasks = svc.harness.make_tasks("train", 3, 0)
        batch = svc.run(tasks, group=2, kind=RolloutKind.train, temperature=1.0, seed=5, tag="t")
        assert len(batch.rollouts) == 6 and len(batch.rewards) == 6
        rows, rewards, merge = rows_and_rewards(batch, RLConfig().transitions)
        assert len(rewards) == 6 and {r.group_id for r in rewards} == {"t-g0", "t-g1", "t-g2"}
        assert merge["merge_attempts"] == 6 and merge["merge_mismatches"] == 0
        assert merge["merge_rows"] == 6 - merge["merge_length_splits"]  # token-in: one row per attempt
        for row in rows:
            assert row.trained_tokens > 0 and len(row.behaviour_logprobs) == len(row.response_ids)

        # common random numbers: the same weights and the same evaluation seed give the same outcomes
        heldout = svc.harness.make_tasks("holdout", 8, 0)
        first = svc.run(heldout, group=1, kind=RolloutKind.holdout, temperature=1.0, seed=9, tag="e1")
        again = svc.run(heldout, group=1, kind=RolloutKind.holdout, temperature=1.0, seed=9, tag="e2")
        tokens = [[s.response_token_ids for s in first.spans[r.rollout_id]] for r in first.rollouts]
        tokens2 = [[s.response_token_ids for s in again.spans[r.rollout_id]] for r in again.rollouts]
        assert tokens == tokens2

        # new weights reach the serving engine
        before = evaluate(svc, heldout, seed=9, tag="e3", greedy=False)
        zeroed = {k: torch.zeros_like(v) for k, v in svc.engine.model.state_dict().items()}
        svc.load_weights(zeroed)
        assert all(float(v.abs().sum()) == 0 for v in svc.engine.model.state_dict().values())
        assert before["tasks"] == 8


def test_train_rl_runs_steps_and_reports_metrics(tmp_path, base_model_dir):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    config = RLConfig(steps=2, tasks_per_step=2, group_size=4, heldout_tasks=6, eval_every=2, parallel=8,
                      trainer=TrainerConfig(lr=1e-4))  # fmt: skip
    result = train_rl(store, base_model_dir, config, out_dir=tmp_path / "cand")
    assert [p["step"] for p in result.curve] == [0, 2]
    assert "greedy" in result.parent and "greedy" in result.candidate
    assert len(result.steps) == 2 and all("merge_mismatch_rate" in m for m in result.steps)
    assert (result.checkpoint / "config.json").exists() and (result.checkpoint / "tokenizer.json").exists()
    assert len(store.query_rollouts(kind=RolloutKind.train)) == 2 * 2 * 4
