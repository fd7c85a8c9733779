"""The demo's home: Dagster's local instance, the approvers and their keys, and the project's working copy
whose train split grows between the cycles (so the sensor cuts snapshot 2)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO_ACTORS = {"release-owner": "demo-release-owner", "default-approver": "demo-default-approver"}
LATE_TRAIN_SHARE = 1 / 8  # of the train tasks "arrive" after cycle 1 (the last ones by id)
# The demo's own keys: the pipeline's (attests receipts, signs the bootstrap move), the roles-admin's.
PIPELINE_ACTOR, ROLES_ADMIN = "demo-pipeline", "demo-roles-admin"


def use_project(path: Path) -> str:
    """Check the project and its tasks, point the pipeline at it (`LD_PROJECT`) and return its summary."""
    from lightning_dagster.project import load_project, load_tasks

    project = load_project(path)
    tasks = load_tasks(project)
    os.environ["LD_PROJECT"] = str(project.file)
    rows = ", ".join(f"{split} {len(items)}" for split, items in tasks.splits.items())
    return f"project: {project.name} ({project.harness.kind} harness; {tasks.file}: {rows})"


def prepare_environment(actors: dict[str, str] = DEMO_ACTORS) -> dict[str, str]:
    """Point Dagster at a local instance in the demo home and give the demo its approvers' keys and roles."""
    from lightning_dagster import paths

    home = paths.home()
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster_home"))
    dagster_home = Path(os.environ["DAGSTER_HOME"])
    dagster_home.mkdir(parents=True, exist_ok=True)
    if not (dagster_home / "dagster.yaml").exists():
        # Dagster's default local SQLite storage; only telemetry (a network call) is turned off.
        (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    os.environ["LD_ROLES_FILE"] = str(write_approvers(home / "approvers.yaml", actors))
    os.environ["LD_PIPELINE_KEY"] = str(keypair(PIPELINE_ACTOR) / f"{PIPELINE_ACTOR}.key")
    os.environ["LD_ROLES_ADMIN_KEY"] = (keypair(ROLES_ADMIN) / f"{ROLES_ADMIN}.pub").read_text().strip()
    return {
        "LIGHTNING_DAGSTER_HOME": str(home),
        "DAGSTER_HOME": os.environ["DAGSTER_HOME"],
        **{name: os.environ[name] for name in ("LD_ROLES_FILE", "LD_PIPELINE_KEY", "LD_ROLES_ADMIN_KEY")},
        **{name: os.environ[name] for name in ("LD_PROJECT", "LD_GATE_POLICY") if os.environ.get(name)},
    }


def approver_keys() -> Path:
    """Where the demo keeps approvers' private keys: in the home, outside models/ and mlartifacts/."""
    from lightning_dagster import paths

    return paths.home() / "approver-keys"


def keypair(actor: str) -> Path:
    """The folder in `approver_keys()` holding `actor`'s key pair (`<actor>.key`, `<actor>.pub`), made once."""
    from lightning_dagster.release.signing import generate_keypair

    keys = approver_keys()
    if not (keys / f"{actor}.key").exists():
        generate_keypair(actor, keys)
    return keys


def write_approvers(path: Path, actors: dict[str, str]) -> Path:
    """A roles file for `actors` (role -> actor), each with a key pair in `approver_keys()`, made once."""
    entries = []
    for role, actor in actors.items():
        public = (keypair(actor) / f"{actor}.pub").read_text().strip()
        entries.append(f"  {actor}:\n    roles: [{role}]\n    key: {public}\n")
    path.write_text("# Who may approve what in the demo, and with which key.\nactors:\n" + "".join(entries))
    return path


def approval_config(pipeline: Any, key: str, approver: tuple[str, str]) -> dict[str, Any]:
    """The `approve` job's op config: `approver` (actor, role) signs the receipt as it stands."""
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.release.receipts import sign_approval

    actor, role = approver
    receipt = ctx.head_receipt(pipeline.get_store(), key)
    approval = sign_approval(receipt, actor=actor, role=role, key=approver_keys() / f"{actor}.key")
    return {"snapshot_key": key, **approval.model_dump(mode="json")}


def promotion_config(pipeline: Any, receipt_id: str, actor: str) -> dict[str, Any]:
    """The `promote` job's op config: `actor` signs the move against the pointer and ledger as they stand."""
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.release.promotion import sign_promotion

    reg = ctx.registry(pipeline)
    signed = sign_promotion(reg, receipt_id, actor=actor, key=approver_keys() / f"{actor}.key")
    return signed.model_dump(mode="json")


def _not_copied(home: Path) -> Callable[[str, list[str]], set[str]]:
    """What copying the project leaves out: the home (it may hold the copy), earlier copies, .git."""
    home = home.resolve()

    def ignore(directory: str, names: list[str]) -> set[str]:
        here = Path(directory).resolve()
        return {
            name
            for name in names
            if name == ".git" or here / name == home or (here / name / ".demo-source").is_file()
        }

    return ignore


def _absolute_outside_paths(original: Path, copy: Path) -> None:
    """Rewrite the copied project file with every relative path pointing outside the folder made absolute."""
    import yaml

    from lightning_dagster.project.config import PATH_KEYS

    root = original.parent.resolve()

    def absolute(value: object, *, must_exist: bool = False) -> object:
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            return value
        path = (root / Path(value).expanduser()).resolve()
        if path.is_relative_to(root) or (must_exist and not path.exists()):
            return value
        return str(path)

    data = yaml.safe_load(original.read_text())
    before = yaml.safe_dump(data, sort_keys=False)
    for keys in PATH_KEYS:
        section = data
        for key in keys[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        if isinstance(section, dict) and keys[-1] in section:
            section[keys[-1]] = absolute(section[keys[-1]])
    command = (data.get("harness") or {}).get("command")
    if isinstance(command, list):  # the harness runs in the copy's folder: its paths are relative to it
        data["harness"]["command"] = [
            absolute(part, must_exist=True) if isinstance(part, str) and "/" in part else part
            for part in command
        ]
    after = yaml.safe_dump(data, sort_keys=False)
    if after != before:
        note = f"# copied from {original} by the demo; paths outside its folder made absolute\n"
        copy.write_text(note + after)


def _drop_jsonl_lines(path: Path, id_column: str, ids: set[str]) -> None:
    """Remove the tasks whose id is in `ids` from the JSONL file `path`, keeping every other line as is."""
    import json

    from lightning_dagster.project.tasks import key_text

    kept = []
    for number, line in enumerate(path.read_bytes().splitlines(keepends=True)):
        text = line.decode("utf-8-sig" if number == 0 else "utf-8").strip()
        row = json.loads(text) if text else None
        if not (isinstance(row, dict) and key_text(row.get(id_column)) in ids):
            kept.append(line)
    path.write_bytes(b"".join(kept))


class WorkingCopy:
    """The project copied into `<home>/demo-project`, without its late train tasks until `add_late_tasks`."""

    def __init__(self, project_file: Path, home: Path) -> None:
        from lightning_dagster.project import ProjectError, load_project, load_tasks

        source = load_project(project_file)
        # the user's own files are checked before the copy, so an error names them, not the copy
        tasks = load_tasks(source)
        self.original = source.tasks.path
        folder = source.file.parent
        self.root = home / "demo-project"
        if not self.original.is_relative_to(folder):
            problem = (
                f"the demo copies the project folder, so its tasks file must be inside it: {self.original}"
            )
            raise ProjectError(source.file, [("tasks.path", problem)])
        self.tasks_file = self.root / self.original.relative_to(folder)
        self.file, self.source_file = self.root / source.file.name, source.file
        # kept across demo runs in one home, but only for the same project with the same tasks
        marker, origin = self.root / ".demo-source", f"{source.file.resolve()}\n{tasks.content_hash}\n"
        if self.root.exists() and (not marker.is_file() or marker.read_text() != origin):
            shutil.rmtree(self.root)
        if not self.root.exists():
            shutil.copytree(folder, self.root, ignore=_not_copied(home))
            _absolute_outside_paths(source.file, self.file)
            self._withhold(source.tasks.id_column)
            marker.write_text(origin)

    def _withhold(self, id_column: str) -> None:
        import pandas as pd

        from lightning_dagster.project import load_project, load_tasks

        train = sorted(str(t["task_id"]) for t in load_tasks(load_project(self.file)).splits["train"])
        late = set(train[len(train) - int(len(train) * LATE_TRAIN_SHARE) :])
        suffix = self.tasks_file.suffix.lower()
        if suffix == ".jsonl":
            _drop_jsonl_lines(self.tasks_file, id_column, late)
            return
        if suffix == ".csv":
            frame = pd.read_csv(self.tasks_file, dtype=str)
            frame[~frame[id_column].astype(str).isin(late)].to_csv(self.tasks_file, index=False)
        else:
            frame = pd.read_parquet(self.tasks_file)
            frame[~frame[id_column].astype(str).isin(late)].to_parquet(self.tasks_file)

    def pin_training(self, given: dict[str, Any]) -> None:
        """The project's `training:` with the demo's `given` over it, so the UI runs the demo's settings."""
        import yaml

        original = yaml.safe_load(self.source_file.read_text()) or {}
        spec = yaml.safe_load(self.file.read_text()) or {}
        spec["training"] = {**(original.get("training") or {}), **given}
        self.file.write_text(yaml.safe_dump(spec, sort_keys=False))

    def add_late_tasks(self) -> int:
        """Put the withheld train tasks back; returns how many train tasks arrived."""
        from lightning_dagster.project import load_project, load_tasks

        before = len(load_tasks(load_project(self.file)).splits["train"])
        shutil.copyfile(self.original, self.tasks_file)
        return len(load_tasks(load_project(self.file)).splits["train"]) - before
