"""The policy measurably learns, judged the way RL is judged: held-out success sampled at T=1.0 on 300 fixed
calc tasks with one evaluation seed for parent and candidate, through the real runner and gateway, after a
fixed number of RL steps from the warm-started parent (fixed seeds throughout). Greedy may not fall."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from lightning_dagster.engine.build import build_base_model
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.project.examples import example_file, example_harness, example_tasks
from lightning_dagster.settings import ServingSettings, TrainingSettings
from lightning_dagster.store import Store
from lightning_dagster.training.cli import sampling_service
from lightning_dagster.training.configs import warm_start_config
from lightning_dagster.training.loop import draw_pools, train_rl
from lightning_dagster.training.warmstart import warm_start

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

# Measured 2026-12-07 (benchmarks/README.md, the learning test): warm start 298 SFT steps, parent held-out
# sampled 0.163, then 0.603 and 0.637 at steps 20 and 25 (+0.457), greedy 0.237 -> 0.707, with kl_coef 0.1.
# The test asks whether RL learns, so it trains with kl_coef 0.1: the default 1.0 holds the candidate near
# its parent's greedy behaviour on purpose (the demo's protected cases), and over these 25 steps it gained
# +0.082 from the same parent (0.163 -> 0.217 / 0.273).
KL_COEF = 0.1
RL_STEPS = 25
LAST_TWO = (RL_STEPS - 5, RL_STEPS)  # evaluations at 0, 20, 25: the candidate is the mean of the last two


@pytest.mark.slow
@pytest.mark.learning  # not in `make test` (CI's budget): `make test-learning`
# ~10 min on a 2-core machine (615 s on 2026-12-07): warm start ~300 SFT steps, 25 RL steps, 3 evaluations.
@pytest.mark.timeout(3600)
def test_candidate_beats_warm_started_parent_in_sampled_success():
    torch.manual_seed(0)
    # Not tmp_path: concurrent pytest sessions rotate old basetemps away while this long test still runs.
    with tempfile.TemporaryDirectory(prefix="ld-learning-") as work:
        run(Path(work))


def run(work: Path) -> None:
    store = Store(f"sqlite:///{work / 'store.db'}")
    base = build_base_model(work / "base", corpus=training_corpus(seed=0), seed=0)
    ws = warm_start(
        store,
        base,
        work / "warm",
        warm_start_config(example_file("calc"), TrainingSettings(), ServingSettings()),
    )
    assert 0.1 <= ws.probe_success <= 0.5, ws.history[-3:]
    # every step runs (no early stop): the candidate is the curve's mean at steps 20 and 25
    t = TrainingSettings(steps=RL_STEPS, tasks_per_step=16, eval_every=LAST_TWO[0], holdout_tasks=300,
                         eval_seed=20261130, learning_rate=1e-4, validation_patience=0, kl_coef=KL_COEF)  # fmt: skip

    def serve():  # as `train` serves
        return sampling_service(
            store, ws.model_dir, ws.resource.resource_id, example_harness("calc"), t, ServingSettings()
        )

    result = train_rl(ws.model_dir, t, draw_pools(example_tasks("calc"), t), serve, base_seed=t.seed)
    points = {p["step"]: p for p in result.curve}
    # successes are multiples of 1/300: round away float noise before comparing with the bar
    candidate = round(sum(points[s]["success"] for s in LAST_TWO) / 2, 9)
    report = json.dumps({"warm_steps": ws.steps, "warm_probe": ws.probe_success, "warm_seconds": ws.seconds,
                         "curve": result.curve, "rl_seconds": result.rl_seconds})  # fmt: skip
    # Evidence for benchmarks/README.md whether the test passes or not (test-artifacts/ is not committed).
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "learning-curve.json").write_text(report)
    assert result.parent["tasks"] == 300
    assert round(candidate - result.parent["success"], 9) >= 0.10, report
    assert round(result.parent["greedy"] - result.candidate["greedy"], 9) <= 0.05, report
