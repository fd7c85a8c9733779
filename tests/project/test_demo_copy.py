"""The demo's working copy of a user's project: what is copied, what is left out, and the late train tasks."""

from __future__ import annotations

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
