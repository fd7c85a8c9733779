"""The user's project: the file `lightning-dagster.yaml` naming their harness, tasks, judge and model, with
optional settings sections, and their tasks read through pandas. Core logic: no Dagster imports.

- `config`: `load_project(path=None) -> Project` (`Harness`, `Tasks`, `Model`), `PROJECT_FILE`.
- `sections`: the `training:` / `serving:` / `gate:` sections and `effective(project, surface)`, the settings
  a CLI, a resource or the pipeline runs with (defaults < the file's section < the surface's own).
- `tasks`: `load_tasks(project) -> TaskSet` (tasks per split, `content_hash`, `require_splits`).
- `references`: `resolve_callable`, `resolve_agent_class`, `resolve_program` for what the file points at.
- `errors`: `ProjectError` (file, dotted key, problem), `TaskDataError` and `TaskFieldConflict`.
- `harness`: `harness_spec(project) -> HarnessSpec`, how the runner runs a `command`, `python` or `agl` harness.
- `agl`: the launcher that runs an Agent Lightning-style class unchanged in its own process.
- `scaffold`: `lightning-dagster init DIR` writes the starter project in `starter/`.
- `cli`: `lightning-dagster project check`, and `add_project_option` / `command_project` /
  `exits_2_on_project_error`.
"""

from lightning_dagster.project.config import PROJECT_FILE, Harness, Model, Project, Tasks, load_project
from lightning_dagster.project.errors import ProjectError, TaskDataError, TaskFieldConflict
from lightning_dagster.project.tasks import TaskSet, load_tasks

__all__ = [
    "PROJECT_FILE",
    "Harness",
    "Model",
    "Project",
    "ProjectError",
    "TaskDataError",
    "TaskFieldConflict",
    "TaskSet",
    "Tasks",
    "load_project",
    "load_tasks",
]
