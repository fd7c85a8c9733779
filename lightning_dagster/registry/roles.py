"""Who may approve what: a YAML file of actors and their roles, kept outside the learner's write surface.

```yaml
actors:
  alice: [default-approver, canary-approver]
  bob: [canary-approver]
```
The file is `$LD_ROLES_FILE`, else `$XDG_CONFIG_HOME/lightning-dagster/roles.yaml` (`~/.config/...`): never a
path under the models directory or the MLflow artifact root, which the trainer writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from lightning_dagster import config
from lightning_dagster.registry.errors import NotAuthorized, RolesConfigError


def default_roles_path() -> Path:
    if os.environ.get("LD_ROLES_FILE"):
        return Path(os.environ["LD_ROLES_FILE"]).resolve()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return (base / "lightning-dagster" / "roles.yaml").resolve()


def learner_write_surface() -> list[Path]:
    """Directories the trainer writes to: a roles file inside one of them could grant itself approval."""
    return [config.models_dir(), config.mlflow_artifact_root()]


@dataclass(frozen=True)
class Roles:
    path: Path
    actors: dict[str, frozenset[str]]

    def require(self, actor: str, role: str) -> None:
        """Raise `NotAuthorized` unless `actor` holds `role` in this file."""
        if role not in self.actors.get(actor, frozenset()):
            raise NotAuthorized(actor, role, f"per {self.path}")


def load_roles(path: Path | str | None = None) -> Roles:
    path = Path(path).resolve() if path is not None else default_roles_path()
    for surface in learner_write_surface():
        if path.is_relative_to(surface.resolve()):
            raise RolesConfigError(f"roles file {path} lies inside the learner's write surface {surface}")
    if not path.is_file():
        raise RolesConfigError(f"roles file {path} does not exist (set LD_ROLES_FILE)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RolesConfigError(f"roles file {path} is not valid YAML: {exc}") from exc
    actors = data.get("actors") if isinstance(data, dict) else None
    if not isinstance(actors, dict):
        raise RolesConfigError(f"roles file {path}: expected a mapping `actors: {{name: [role, ...]}}`")
    parsed: dict[str, frozenset[str]] = {}
    for actor, roles in actors.items():
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            raise RolesConfigError(f"roles file {path}: actors.{actor} must be a list of role names")
        parsed[str(actor)] = frozenset(roles)
    return Roles(path=path, actors=parsed)
