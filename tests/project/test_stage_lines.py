"""The demo's stage line for a candidate: its figures, and a plain cause when nothing could be trained."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_dagster.demo.progress import asset_figures

TRAINING = SimpleNamespace(tasks_per_step=4, group_size=4, steps=2)
META = {
    "steps": 2,
    "chosen_step": 2,
    "early_stop": "",
    "final_reward": 0.25,
    "model_version": "models:/policy/2",
}


def test_a_candidate_line_names_its_steps_checkpoint_and_version():
    line = asset_figures("candidate_resource", {**META, "trained_rows": 96}, TRAINING)
    assert line == (
        "2 of 2 RL steps x 16 rollouts, final sampled reward 0.250, checkpoint of step 2; candidate "
        "models:/policy/2"
    )


def test_a_candidate_no_step_trained_says_why_it_equals_its_parent():
    # every group's rewards equal (all 0 here): no advantage, no update; the gate's check 1 then holds it
    line = asset_figures("candidate_resource", {**META, "final_reward": 0.0, "trained_rows": 0}, TRAINING)
    assert line.endswith(
        "no step had a learning signal (in every group all rewards were equal), so the candidate has the "
        "parent's weights"
    )
    # metadata written before the figure existed says nothing about it
    assert "learning signal" not in asset_figures("candidate_resource", META, TRAINING)


def test_the_rollouts_line_says_each_failure_reason_with_its_example_and_folder():
    from lightning_dagster.runner.summary import failure_lines

    found = {"exit_nonzero": {"rollouts": 8, "example": "Error: 404 model", "dir": "/h/attempts/ro-1/at-1"}}
    meta = {"rollouts": 8, "rollouts_per_s": 2.0, "reward_mean": 0.0, "retries": 0}
    line = asset_figures("rollouts", {**meta, "failures": failure_lines(found)}, TRAINING)
    assert line.splitlines() == [
        "8 rollouts from the parent (2.0/s), reward mean 0.000, retries 0",
        "  failed: exit_nonzero in 8 rollout(s), e.g. 'Error: 404 model' (files: /h/attempts/ro-1/at-1)",
    ]
    assert asset_figures("rollouts", meta, TRAINING).count("\n") == 0  # none failed: one line
