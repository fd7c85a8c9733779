"""The user's project: `lightning-dagster.yaml` (harness, tasks, judge, model, settings) and its tasks."""

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
