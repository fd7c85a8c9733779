"""One RL loop, three callers: `lightning-dagster train` (its handler, in this process), the pipeline's
`candidate_resource` stage on a materialized snapshot, and the same asset run by Dagster in its Pipes child
process make the same checkpoint, byte for byte (`engine.build.checkpoint_hash`), from the same parent,
settings and seeds.

The inputs are made equal, not assumed: the project has two train tasks, one held back for validation, so
every run's train pool is the other one whatever seed drew it; `train --seed` is the snapshot's base
sampling seed, so its step 1 samples exactly the rollouts the snapshot's first batch holds (the stage trains
step 1 on those); step 2 samples on-policy in every run. Rollouts run four at a time, so which requests
share an engine batch depends on timing: a token's logprob moves in its last bits with its batch mates (the
tokens themselves do not), and the loss weighs a sampler/trainer gap that small as none (`tis_noise`), so
the update does not depend on it (with the gap weighed as is, the three checkpoints differ)."""

from __future__ import annotations

import json
import os

import dagster as dg
import pytest
import yaml

from lightning_dagster.cli import main
from lightning_dagster.engine.build import checkpoint_hash
from lightning_dagster.orchestration.assets import candidate_resource
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import (
    GateResource,
    ProjectResource,
    ServingResource,
    TrainingResource,
    default_pipeline,
)
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.bootstrap import bootstrap_parent
from lightning_dagster.pipeline.snapshots import load_manifest, save_manifest
from lightning_dagster.pipeline.stages import rollouts, snapshot, training
from lightning_dagster.project.examples import example_tasks
from lightning_dagster.settings import flag_of
from lightning_dagster.training.cli import TRAINING
from tests.dagster.conftest import TINY_POLICY

# A one-call agent rewarded by its reply's length: the untrained base model's sampled replies differ, so
# each group's rewards do, and every step has a learning signal.
LENGTH_AGENT = """
def solve(task, client):
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=12
    )
    return len(reply.choices[0].message.content or "") / 100
"""
SETTINGS = {"steps": 2, "tasks_per_step": 1, "group_size": 4, "holdout_tasks": 2, "protected_tasks": 0,
            "canary_tasks": 0, "validation_tasks": 1, "validation_every": 1, "validation_patience": 0,
            "learning_rate": 1e-3}  # fmt: skip
KEYS = ("snap-20261130T0800Z-0000aaaa", "snap-20261130T0800Z-0000bbbb")


def length_project(root):
    calc = example_tasks("calc")
    rows = calc.splits["train"][:2] + calc.splits["holdout"][:2]
    root.mkdir()
    (root / "length_agent.py").write_text(LENGTH_AGENT)
    (root / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    project = {
        "name": "length",
        "harness": {"python": "length_agent:solve"},
        "tasks": {"path": "tasks.jsonl"},
    }
    (root / "lightning-dagster.yaml").write_text(yaml.safe_dump(project))
    return root


@pytest.mark.slow
def test_train_the_stage_and_its_pipes_child_make_the_same_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))  # a registry of its own
    monkeypatch.setenv("LD_TRAINER_THREADS", "1")  # the Pipes child inherits it
    project = length_project(tmp_path / "length")
    p = default_pipeline(
        deferred=False,
        project=ProjectResource(project=str(project)),
        training=TrainingResource(**SETTINGS),
        serving=ServingResource(parallel=4),
        gate=GateResource(policy_path=str(TINY_POLICY), pipeline_key_path=os.environ["LD_PIPELINE_KEY"]),
    )
    parent = bootstrap_parent(p).metadata["base_model"]  # no demonstrations: the base model is the parent
    # two snapshots of the same task sets (so the same base sampling seed), each up to its transitions
    for key in KEYS:
        if key != KEYS[0]:
            save_manifest(p, key, load_manifest(p, KEYS[0]))
        snapshot.tasks(p, key)
        snapshot.update_plan(p, key)
        rollouts.rollouts(p, key)
        training.training_transitions(p, key)

    steps: list[dict] = []
    stage = training.candidate_resource(p, KEYS[0], log=steps.append).metadata
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(snapshots.name, [KEYS[1]])
    child = dg.materialize(
        [candidate_resource],
        partition_key=KEYS[1],
        instance=instance,
        resources={"pipeline": p, "trainer_pipes": dg.PipesSubprocessClient()},
    )
    (event,) = child.get_asset_materialization_events()
    through_pipes = event.materialization.metadata

    flags = [
        arg for name, value in SETTINGS.items() if name in TRAINING for arg in (flag_of(name), str(value))
    ]
    argv = ["train", "--project", str(project), "--parent", parent, "--out", str(tmp_path / "cli"), "--json",
            "--seed", str(load_manifest(p, KEYS[0]).base_seed), "--parallel", "4",
            "--store-url", f"sqlite:///{tmp_path / 'cli.db'}", *flags]  # fmt: skip
    assert main(argv) == 0

    weights = checkpoint_hash(tmp_path / "cli")
    assert stage["weights_hash"] == weights == checkpoint_hash(ctx.candidate_dir(KEYS[0]))
    assert through_pipes["weights_hash"].value == weights == checkpoint_hash(ctx.candidate_dir(KEYS[1]))
    # both steps had a learning signal (step 1's from the first batch), and all chose alike
    assert weights != checkpoint_hash(parent)
    assert [m["step"] for m in steps] == [1, 2] and all(m["trained_rows"] > 0 for m in steps)
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stage["chosen_step"] == through_pipes["chosen_step"].value == cli["chosen_step"]
