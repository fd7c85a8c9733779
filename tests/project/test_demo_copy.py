"""The demo's working copy of a user's project: what is copied, what is left out, and the late train tasks."""

from __future__ import annotations

import yaml

from lightning_dagster.demo.setup import WorkingCopy
from lightning_dagster.project import load_project, load_tasks
from tests.project.helpers import task_rows, write_project


def test_a_project_run_from_its_own_folder_is_copied_without_its_home_inside_it(tmp_path):
    # `lightning-dagster demo --project .` run in the project folder: the default home (./.lightning_dagster)
    # is inside the folder being copied, and the copy is made inside the home. It once copied itself into
    # itself until the path was too long (shutil.Error, File name too long).
    folder = tmp_path / "my-agent"
    file = write_project(folder, rows=task_rows(per_split=8))
    home = folder / ".lightning_dagster"
    (home / "models").mkdir(parents=True)
    (home / "store.db").write_text("not for the copy")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "data").mkdir()
    (folder / "data" / "notes.txt").write_text("kept")

    copy = WorkingCopy(file, home)

    assert copy.root == home / "demo-project"
    assert (copy.root / "agent.py").read_text() == (folder / "agent.py").read_text()
    assert (copy.root / "data" / "notes.txt").read_text() == "kept"
    assert not (copy.root / ".lightning_dagster").exists()
    assert not (copy.root / ".git").exists()
    train = load_tasks(load_project(copy.file)).splits["train"]
    assert 0 < len(train) < 8  # the late train tasks are withheld until cycle 2
    assert copy.add_late_tasks() == 8 - len(train)
    assert len(load_tasks(load_project(copy.file)).splits["train"]) == 8

    again = WorkingCopy(file, home)  # a second demo in the same home keeps the copy, added tasks included
    assert len(load_tasks(load_project(again.file)).splits["train"]) == 8
    assert not (again.root / ".lightning_dagster").exists()


def test_an_earlier_demo_copy_elsewhere_in_the_folder_is_not_copied(tmp_path):
    folder = tmp_path / "agent"
    file = write_project(folder, rows=task_rows(per_split=4))
    old = folder / "old-home" / "demo-project"
    old.mkdir(parents=True)
    (old / ".demo-source").write_text("elsewhere\n")
    (old / "big.bin").write_bytes(b"x" * 1024)

    copy = WorkingCopy(file, tmp_path / "home")

    assert (copy.root / "old-home").is_dir()
    assert not (copy.root / "old-home" / "demo-project").exists()


def test_paths_outside_the_project_folder_are_absolute_in_the_copy_and_inside_ones_stay_relative(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "demos.jsonl").write_text('{"messages": []}\n')
    (shared / "agent.py").write_text("print('shared agent')\n")
    folder = tmp_path / "projects" / "agent"
    changes = {
        "harness.command": ["python", "../../shared/agent.py", "--flag", "out/x"],
        "model.warm_start": "../../shared/demos.jsonl",
    }
    file = write_project(folder, changes, rows=task_rows(per_split=8))
    (folder / "local.jsonl").write_text("{}\n")

    copy = WorkingCopy(file, tmp_path / "home")

    data = yaml.safe_load(copy.file.read_text())
    assert data["model"]["warm_start"] == str(shared / "demos.jsonl")
    assert data["harness"]["command"] == ["python", str(shared / "agent.py"), "--flag", "out/x"]
    assert data["tasks"]["path"] == "tasks.jsonl"  # inside: the copy's own tasks file
    copied = load_project(copy.file)
    assert copied.model.warm_start == shared / "demos.jsonl"
    assert copied.tasks.path == copy.root / "tasks.jsonl"


def test_a_project_with_only_inside_paths_keeps_its_project_file_byte_for_byte(tmp_path):
    folder = tmp_path / "agent"
    file = write_project(folder, rows=task_rows(per_split=8))
    file.write_text("# my comment\n" + file.read_text())
    copy = WorkingCopy(file, tmp_path / "home")
    assert copy.file.read_bytes() == file.read_bytes()


def test_kept_jsonl_task_lines_are_copied_byte_for_byte(tmp_path):
    folder = tmp_path / "agent"
    write_project(folder, rows=task_rows(per_split=8))
    # number formats, unicode escapes, spacing and key order json.dumps (or pandas) would each rewrite
    lines = [
        f'{{"split": "{row["split"]}",  "task_id":"{row["task_id"]}", "family": "{row["family"]}", '
        f'"answer": 1.50, "big": 1e5, "text": "caf\\u00e9 \\ud83d\\ude00", "raw": "café", "neg": -0.0}}'
        for row in task_rows(per_split=8)
    ]
    original = ("\n".join(lines) + "\n").encode()
    (folder / "tasks.jsonl").write_bytes(original)
    file = folder / "lightning-dagster.yaml"

    copy = WorkingCopy(file, tmp_path / "home")

    kept = copy.tasks_file.read_bytes().splitlines(keepends=True)
    assert 0 < len(kept) < len(lines)
    assert set(kept) <= set(original.splitlines(keepends=True))  # each kept line exactly as written
    late = [line for line in original.splitlines(keepends=True) if line not in kept]
    assert late and all(b'"split": "train"' in line for line in late)
    assert copy.add_late_tasks() == len(late)
    assert copy.tasks_file.read_bytes() == original


def test_the_demos_training_settings_are_pinned_in_the_copy_for_the_ui_and_replaced_by_the_next_demo(tmp_path):
    """The UI's code location reads the copy's project file: with the demo's settings in its `training:`
    section it fingerprints the evaluation as the demo's runs did (else `--quick`'s receipts read stale).
    The next demo's settings replace them over the project's own section."""
    from lightning_dagster.orchestration.resources import TrainingResource
    from lightning_dagster.pipeline.context import project_source
    from lightning_dagster.project.sections import effective

    folder = tmp_path / "agent"
    file = write_project(folder, rows=task_rows(per_split=4))
    spec = yaml.safe_load(file.read_text())
    file.write_text(yaml.safe_dump({**spec, "training": {"seed": 3, "steps": 5}}))
    copy = WorkingCopy(file, tmp_path / "home")

    copy.pin_training(TrainingResource(holdout_tasks=8, steps=2).given())
    read = effective(project_source(copy.file).project, TrainingResource())
    assert (read.holdout_tasks, read.steps, read.seed) == (8, 2, 3)

    copy.pin_training({})  # a full demo next: the project's own section again
    read = effective(project_source(copy.file).project, TrainingResource())
    assert (read.holdout_tasks, read.steps, read.seed) == (TrainingResource().holdout_tasks, 5, 3)
