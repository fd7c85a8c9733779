"""The user's project: the file `lightning-dagster.yaml` naming their harness, tasks, judge and model, with
optional settings sections (`sections`), and their tasks read through pandas (`tasks`). Core logic: no
Dagster imports.
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
