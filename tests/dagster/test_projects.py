"""A user project through the pipeline: its tasks file becomes the snapshot's task sets (and its key), the
`tasks` asset shows the project, the sensor cuts on an edited tasks file, and the whole graph runs on it.

Most tests stand the built-in calc agent in for the project's harness (the seam
`pipeline.context.project_harness`); the whole-graph test runs the project's own `python:` harness, a user
module that answers with the calc agent's tool loop, through the real project path.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml
from mlflow import MlflowClient

from lightning_dagster.demo import run_snapshot
from lightning_dagster.gate.ledger import ReceiptLedger
from lightning_dagster.orchestration.assets import snapshot_assets
from lightning_dagster.orchestration.assets import tasks as tasks_asset
from lightning_dagster.orchestration.definitions import build_definitions
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import ProjectResource
from lightning_dagster.orchestration.sensors import continual_learning_sensor, stale_evidence_sensor
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.snapshots import build_manifest, freeze_tasks, load_manifest
from lightning_dagster.project import TaskDataError, load_project, load_tasks
from lightning_dagster.project.examples import EXAMPLES_DIR, example_harness, example_tasks
from lightning_dagster.training.selection import reserved_validation
from tests.dagster.conftest import TINY_POLICY, pipeline_for, resume_loop

# Rows per split of the test dataset: fewer train rows than 2 steps x 4 tasks (so train cycles), more
# held-out rows than the 8 the tiny settings ask for (so holdout is capped), protected exactly 4.
ROWS = {"train": 6, "holdout": 10, "protected": 4, "canary": 2}


@pytest.fixture(autouse=True)
def calc_stand_in(request, monkeypatch):
    if "own_harness" not in request.keywords:
        own = ctx.project_harness  # the built-in examples keep their own harness
        monkeypatch.setattr(
            ctx,
            "project_harness",
            lambda project: own(project) if project.root.parent == EXAMPLES_DIR else example_harness("calc"),
        )


# A user's in-process harness: `solve(task, client)` with an OpenAI client, returning the reward; it posts
# its answer to the file its `prepare` hook made, which its `verify` hook re-reads.
USER_HARNESS = """
import json
from pathlib import Path

from lightning_dagster.harnesses.calc.agent import run_episode, score


def prepare(task, workdir):
    workdir.mkdir(parents=True, exist_ok=True)
    return {**task, "posted": str(workdir / "posted.json")}


def solve(task, client):
    answer = run_episode(client, task["question"])
    Path(task["posted"]).write_text(json.dumps(answer))
    return score(answer, task["answer"])


def verify(task):
    try:
        answer = json.loads(Path(task["posted"]).read_text())
    except (OSError, ValueError) as exc:
        return {"verified": False, "harmful_effect": None, "reason": f"unreadable: {exc}"}
    return {"verified": True, "harmful_effect": False, "reason": f"posted {answer}"}
"""


def calc_rows(rows: dict[str, int], seed: int = 7) -> list[dict]:
    return [task for split, n in rows.items() for task in example_tasks("calc").draw(split, n, seed)]


def write_project(root: Path, rows: list[dict], name: str = "calc-project") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    project = {
        "name": name,
        "harness": {"command": ["python", "-m", "lightning_dagster.harnesses.calc.agent"]},
        "tasks": {"path": "tasks.jsonl"},
    }
    (root / "lightning-dagster.yaml").write_text(yaml.safe_dump(project))
    return root


def project_pipeline(root: Path, policy: Path | None = None):
    return pipeline_for(policy).model_copy(update={"project": ProjectResource(project=str(root))})


def test_project_snapshot_draws_every_split_from_the_dataset(embedded_home, tmp_path):
    root = write_project(tmp_path / "proj", calc_rows(ROWS))
    p = project_pipeline(root)
    dataset = load_tasks(load_project(root))
    manifest = build_manifest(p, train_seed=11)
    ids = {split: {t["task_id"] for t in dataset.splits[split]} for split in ROWS}
    train = [t["task_id"] for t in manifest.splits.train]
    # Half of the 6 train rows are held back as checkpoint selection's validation cases; steps x
    # tasks_per_step = 8 come from the other 3: every row once per seeded pass.
    reserved = reserved_validation(dataset, p.training.validation_tasks, p.training.eval_seed)
    assert p.training.validation_tasks >= 3 and len(reserved) == 3 and reserved <= ids["train"]
    trainable = ids["train"] - reserved
    assert len(train) == 8 and set(train[:3]) == set(train[3:6]) == trainable and set(train[6:]) <= trainable
    assert len(set(train[6:])) == 2
    # Closed sets: at most the setting, no repeats, and the same for any train seed.
    holdout = [t["task_id"] for t in manifest.splits.holdout]
    assert len(holdout) == 8 and len(set(holdout)) == 8 and set(holdout) <= ids["holdout"]
    assert {t["task_id"] for t in manifest.splits.protected} == ids["protected"]
    assert build_manifest(p, train_seed=12).splits.holdout == manifest.splits.holdout
    # The canary runs the user's project (here its calc stand-in) on the project's canary split.
    canary = [t["task_id"] for t in manifest.splits.canary]
    assert manifest.canary_harness == "calc" and canary and set(canary) <= ids["canary"]
    assert manifest.harness == "calc"
    assert manifest.dataset.project == "calc-project" and manifest.dataset.harness_kind == "command"
    assert manifest.dataset.content_hash == dataset.content_hash
    assert {split: sum(c.values()) for split, c in manifest.dataset.rows.items()} == ROWS


def test_snapshot_digest_follows_the_dataset_rows_not_their_order(embedded_home, tmp_path):
    rows = calc_rows(ROWS)
    first = build_manifest(project_pipeline(write_project(tmp_path / "a", rows)), train_seed=5)
    reordered = build_manifest(project_pipeline(write_project(tmp_path / "a", rows[::-1])), train_seed=5)
    assert reordered.digest == first.digest
    changed = [dict(row) for row in rows]
    changed[-1]["answer"] += 1  # a canary row: the canary set holds it, and the dataset hash
    edited = build_manifest(project_pipeline(write_project(tmp_path / "a", changed)), train_seed=5)
    assert edited.splits.model_dump(exclude={"canary"}) == first.splits.model_dump(exclude={"canary"})
    assert edited.dataset.content_hash != first.dataset.content_hash and edited.digest != first.digest


@pytest.mark.own_harness
def test_a_user_project_without_verify_runs_its_own_canary_never_the_ledger(
    embedded_home, tmp_path, monkeypatch
):
    root = write_project(tmp_path / "proj", calc_rows(ROWS))
    p = project_pipeline(root)
    loaded, real = [], ctx.project_source
    monkeypatch.setattr(ctx, "project_source", lambda path: loaded.append(Path(path)) or real(path))
    assert ctx.harness_source(p).spec.verify is None
    manifest, inputs = build_manifest(p, train_seed=3), ctx.fingerprint_inputs(p)
    # Only the user's project was ever loaded as a harness (no built-in example stands in for its canary);
    # its canary tasks are drawn from its own canary split.
    assert loaded and set(loaded) == {root}
    canary = {t["task_id"] for t in manifest.splits.canary}
    user_canary = {t["task_id"] for t in load_tasks(load_project(root)).splits["canary"]}
    assert manifest.canary_harness == manifest.harness == "calc-project" and canary and canary <= user_canary
    assert set(inputs["tool_contract"]) == {"calc-project"}
    assert inputs["destinations"] == ["calc-project:destination"]


def test_the_builtin_calc_example_re_reads_its_own_effects_so_its_canary_is_its_own(embedded_home):
    p = pipeline_for()
    source = ctx.harness_source(p)
    assert source.name == "calc" and source.spec.prepare is not None and source.spec.verify is not None
    manifest = build_manifest(p, train_seed=3)
    assert manifest.canary_harness == "calc" and manifest.splits.canary
    assert {t["split"] for t in manifest.splits.canary} == {"canary"}


def test_an_empty_split_the_plan_needs_is_named_before_anything_is_frozen(embedded_home, tmp_path):
    root = write_project(tmp_path / "proj", calc_rows({**ROWS, "protected": 0}))
    p = project_pipeline(root)
    key = "snap-20261130T0800Z-0000e000"
    with pytest.raises(TaskDataError, match="no tasks in split protected") as err:
        freeze_tasks(p, key)
    assert err.value.keys == ["tasks.split_column"]
    with pytest.raises(ctx.StageMissing):
        load_manifest(p, key)


def test_tasks_asset_shows_the_project_rows_per_split_and_family_and_a_preview(embedded_home, tmp_path):
    root = write_project(tmp_path / "proj", calc_rows(ROWS))
    p = project_pipeline(root)
    key = "snap-20261130T0800Z-0000a55e"
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(snapshots.name, [key])
    result = dg.materialize([tasks_asset], partition_key=key, resources={"pipeline": p}, instance=instance)
    (event,) = result.get_asset_materialization_events()
    meta = event.materialization.metadata
    assert meta["project"].value == "calc-project" and meta["harness_kind"].value == "command"
    assert meta["dataset"].value == str(root / "tasks.jsonl")
    assert meta["dataset_hash"].value == load_tasks(load_project(root)).content_hash
    rows = meta["dataset_rows"]
    assert [c.name for c in rows.schema.columns] == ["family", "train", "holdout", "protected", "canary"]
    by_family = {r.data["family"]: r.data for r in rows.records}
    assert {k: v for k, v in by_family.pop("(all)").items() if k != "family"} == ROWS
    families = load_tasks(load_project(root)).families("holdout")
    assert {family: r["holdout"] for family, r in by_family.items() if r["holdout"]} == dict(families)
    preview = meta["preview"]
    manifest = load_manifest(p, key)
    assert [r.data["task_id"] for r in preview.records] == [t["task_id"] for t in manifest.splits.train[:5]]
    types = {c.name: c.type for c in preview.schema.columns}
    assert types["question"] == "string" and types["answer"] == "int"
    assert meta["train_tasks"].value == 8 and meta["holdout_tasks"].value == 8


def _tick(p, instance, cursor=None):
    with dg.build_sensor_context(instance=instance, resources={"pipeline": p}, cursor=cursor) as context:
        return continual_learning_sensor(context)


def _cut(result) -> dict:
    return result.run_requests[0].run_config["ops"]["tasks"]["config"]


@pytest.mark.slow  # pays for the session's bootstrap when run first (the sensor needs a parent)
def test_sensor_cuts_a_snapshot_when_the_tasks_file_changes(bootstrapped, tmp_path):
    rows = calc_rows(ROWS)
    root = write_project(tmp_path / "proj", rows)
    p = project_pipeline(root)
    resume_loop(p)  # a receipt judged earlier in the session's store may have paused it
    instance = dg.DagsterInstance.ephemeral()
    first = _tick(p, instance)
    (key,) = first.dynamic_partitions_requests[0].partition_keys
    assert json.loads(first.cursor)["pool"] == load_tasks(load_project(root)).content_hash
    frozen = freeze_tasks(p, key, _cut(first))  # its run's `tasks`
    idle = _tick(p, instance, first.cursor)
    assert not idle.run_requests and "task pool unchanged" in idle.skip_reason.skip_message

    rows[0] = {**rows[0], "question": rows[0]["question"] + " Count carefully."}
    write_project(root, rows)
    edited = _tick(p, instance, first.cursor)
    (key2,) = edited.dynamic_partitions_requests[0].partition_keys
    new_hash = load_tasks(load_project(root)).content_hash
    assert key2 != key and freeze_tasks(p, key2, _cut(edited)).dataset.content_hash == new_hash
    assert json.loads(edited.cursor)["pool"] == new_hash
    assert load_manifest(p, key) == frozen and frozen.dataset.content_hash != new_hash


@pytest.mark.slow
@pytest.mark.own_harness
def test_the_whole_graph_runs_on_a_user_project_and_mlflow_shows_its_data(bootstrapped, tmp_path):
    # 16 train rows: half are held back for validation, so RL trains on 8 distinct tasks. On 3 (the 6 of
    # ROWS) that were hard for the parent, every rollout of a step failed now and then (0-6% success per
    # task): no advantage, the candidate equalled its parent and check 1 rightly held it.
    root = write_project(tmp_path / "proj", calc_rows({**ROWS, "train": 16}))
    (root / "user_harness.py").write_text(USER_HARNESS)
    spec = yaml.safe_load((root / "lightning-dagster.yaml").read_text())
    spec["harness"] = {
        "python": "user_harness:solve",
        "prepare": "user_harness:prepare",
        "verify": "user_harness:verify",
    }
    (root / "lightning-dagster.yaml").write_text(yaml.safe_dump(spec))
    p = project_pipeline(root, TINY_POLICY)
    defs = build_definitions(
        deferred=False, **{name: getattr(p, name) for name in ("project", "training", "gate")}
    )
    instance = dg.DagsterInstance.ephemeral()
    key = "snap-20261130T0800Z-00000f11"
    instance.add_dynamic_partitions(snapshots.name, [key])
    results = run_snapshot(defs, instance, key, approver=("alice", "release-owner"))
    failures = [
        e.event_specific_data.error.to_string() for r in results for e in r.all_events if e.is_step_failure
    ]
    assert all(r.success for r in results), "\n".join(failures)
    done = {e.asset_key.to_user_string() for r in results for e in r.get_asset_materialization_events()}
    assert done == {a.key.to_user_string() for a in snapshot_assets}
    store, manifest = p.get_store(), load_manifest(p, key)
    receipt = ctx.find_receipt(store, key)
    by_kind: dict = {}
    for r in store.query_rollouts(snapshot_key=key):
        by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    assert by_kind == receipt.plan.expected_rollouts
    trained = [r for r in store.query_rollouts(snapshot_key=key) if r.kind.value == "train"]
    assert {r.task_id for r in trained} == {t["task_id"] for t in manifest.splits.train}
    # The project's own harness ran them, and its returned rewards are recorded for them.
    assert {r.harness for r in trained} == {"calc-project"}
    assert len(store.list_rewards(rollout_ids=[r.rollout_id for r in trained])) == len(trained)
    # The canary ran the project's own harness on its canary split, each outcome re-read by its `verify`.
    assert sorted(t.task_id for t in receipt.canary.tasks) == sorted(
        t["task_id"] for t in manifest.splits.canary
    )
    assert all(t.verified and t.evidence.startswith("posted ") for t in receipt.canary.tasks)
    assert manifest.canary_harness == "calc-project" and receipt.canary.unverifiable is None

    # The candidate's MLflow run names the data that made it: the frozen train and held-out sets.
    run_id = ctx.load_stage(store, key, "candidate_resource")["run_id"]
    client = MlflowClient(p.mlflow.resolved_uri())
    inputs = {d.dataset.name: d for d in client.get_run(run_id).inputs.dataset_inputs}
    assert set(inputs) == {f"{key}/train", f"{key}/holdout"}
    holdout = inputs[f"{key}/holdout"].dataset
    assert holdout.digest == manifest.split_digests["holdout"][:36]
    source = json.loads(holdout.source)
    assert source["uri"] == (root / "tasks.jsonl").resolve().as_uri()
    assert source["content_hash"] == manifest.split_hash("holdout")
    assert json.loads(holdout.profile)["num_rows"] == 8
    columns = {c["name"] for c in json.loads(holdout.schema)["mlflow_colspec"]}
    assert {"task_id", "family", "question", "answer", "split"} <= columns
    assert {t.value for t in inputs[f"{key}/train"].tags} == {"training"}

    # The run's MLflow tags and metrics say what the ledger says: the verdict and the held-out figures.
    run = client.get_run(run_id)
    assert run.data.tags["verdict"] == receipt.gate.verdict
    assert run.data.tags["receipt_version"] == str(len(ReceiptLedger(store).history(receipt.receipt_id)))
    gate = {c.check_name: c for r in results for c in r.get_asset_check_evaluations()}
    figures = gate["heldout_margin"].metadata["figures"].data
    assert round(run.data.metrics["heldout_margin"], 4) == figures["margin"]

    # Staleness follows evidence: train tasks added leave the receipt as judged; edited held-out cases void
    # checks 4 and 5 and name the held-out set's change.
    def stale_tick():
        with dg.build_sensor_context(instance=instance, resources={"pipeline": p}) as context:
            return stale_evidence_sensor(context)

    rows = [json.loads(line) for line in (root / "tasks.jsonl").read_text().splitlines()]
    more = [{**r, "task_id": f"{r['task_id']}-more"} for r in rows if r["split"] == "train"]
    write_project(root, rows + more)
    assert not stale_tick().asset_events
    edited = [{**r, "question": r["question"] + " (revised)"} if r["split"] == "holdout" else r for r in rows]
    write_project(root, edited + more)
    (observation,) = stale_tick().asset_events
    meta = {k: v.value for k, v in observation.metadata.items()}
    assert meta["stale_checks"] == [4, 5] and meta["changed"] == ["task_distribution"]
    (change,) = meta["changed_settings"]["task_distribution"]
    assert change.startswith("holdout: sha256:") and "task_distribution" in observation.description


def test_demo_with_a_broken_project_exits_2_naming_the_file_before_anything_runs(
    tmp_path, capsys, monkeypatch
):
    import os

    from lightning_dagster.cli import main

    monkeypatch.delenv("LD_PROJECT", raising=False)
    root = write_project(tmp_path / "proj", calc_rows(ROWS))
    (root / "tasks.jsonl").write_text('{"task_id": "a", "family": "add", "split": "training"}\n')
    assert main(["demo", "--quick", "--project", str(root)]) == 2
    err = capsys.readouterr().err
    assert str(root / "tasks.jsonl") in err and "'training' in rows 1 is not a split" in err
    assert "LD_PROJECT" not in os.environ  # the pipeline was never pointed at it


def test_a_snapshot_cut_freezes_the_same_tasks_and_seed_at_any_time_and_in_any_folder(
    embedded_home, tmp_path
):
    """Reproducible runs: the train seed comes from the settings' seed and the evidence, never the clock, and
    the sampling seed from the content, never the tasks file's folder. Another settings seed draws anew."""
    import datetime as dt

    from lightning_dagster.orchestration.resources import TrainingResource
    from lightning_dagster.pipeline.triggers import Watermark, cut_snapshot, new_evidence

    rows = calc_rows(ROWS)

    def cut(folder: str, when: dt.datetime, seed: int = 0):
        p = project_pipeline(write_project(tmp_path / folder, rows))
        if seed:
            p = p.model_copy(
                update={"training": TrainingResource(**{**p.training.model_dump(), "seed": seed})}
            )
        cut = cut_snapshot(p, new_evidence(p, Watermark(), force=True), when)
        return cut.key, freeze_tasks(p, cut.key, cut.config)

    (key_a, a), (key_b, b) = (
        cut("a", dt.datetime(2026, 12, 1, tzinfo=dt.UTC)),
        cut("b", dt.datetime.now(dt.UTC)),
    )
    assert key_a != key_b and a.dataset.path != b.dataset.path  # other keys, other folders
    assert (a.train_seed, a.splits, a.base_seed) == (b.train_seed, b.splits, b.base_seed)
    _, other = cut("c", dt.datetime(2026, 12, 1, tzinfo=dt.UTC), seed=7)
    assert other.train_seed != a.train_seed and other.base_seed != a.base_seed
