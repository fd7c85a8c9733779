"""The project file's settings sections (`training:`, `serving:`, `gate:`) and `effective`, the one way every
surface gets its settings: the class's defaults < the file's section < the surface's own `given()`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationInfo, field_validator

from lightning_dagster.settings import (
    CONCERNS,
    GateSettings,
    ServingSettings,
    Settings,
    TrainingSettings,
    concern_of,
)

if TYPE_CHECKING:
    from lightning_dagster.project.config import Project

S = TypeVar("S", bound=Settings)

# Keys from before the settings sections, with their replacement: a file still giving one is refused.
RENAMED: dict[tuple[str, ...], str] = {
    ("model", "upstream"): "serving.upstream_url (model.tokenizer stays the served model's tokenizer)",
    ("harness", "timeout_s"): "training.attempt_timeout_s",
    ("harness", "max_attempts"): "training.max_attempts",
    ("policy",): "gate.policy_path",
}


def existing_path(value: str | Path, root: Path, *, directory: bool = False) -> Path:
    """`value` resolved against the project folder `root`; ValueError unless it is an existing file (folder)."""
    path = (root / Path(value).expanduser()).resolve()
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if directory and not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    if not directory and not path.is_file():
        raise ValueError(f"{path} is not a file")
    return path


class ServingSection(ServingSettings):
    """`serving:` of a project file: the serving settings, checked as the file is loaded."""

    @field_validator("upstream_url")
    @classmethod
    def _upstreams(cls, value: str) -> str:
        if value:
            # the gateway's own parser, so the pipeline refuses nothing the file accepted
            from lightning_dagster.gateway.upstreams import upstream_urls

            upstream_urls(value)
        return value

    @field_validator("secret")
    @classmethod
    def _no_secret(cls, value: str) -> str:
        if value:
            raise ValueError(
                "not read from a project file: the harness runs in the project folder and could read it "
                "(left empty, each run makes a fresh secret; a gateway of your own takes --secret-file)"
            )
        return value


class GateSection(GateSettings):
    """`gate:` of a project file: its paths are relative to the project folder, and the policy must load."""

    @field_validator("policy_path", "roles_path")
    @classmethod
    def _relative_to_the_project(cls, value: str, info: ValidationInfo) -> str:
        if not value or info.context is None:  # empty, or a default built without a file
            return value
        path = existing_path(value, info.context["root"])
        if info.field_name == "policy_path":
            from lightning_dagster.gate.errors import InvalidInput
            from lightning_dagster.gate.policy import load_policy

            try:
                load_policy(path)
            except InvalidInput as err:
                raise ValueError(str(err)) from None
        return str(path)


SECTIONS: dict[str, type[Settings]] = {  # each section's fields are exactly its concern's settings
    "training": TrainingSettings,
    "serving": ServingSection,
    "gate": GateSection,
}


def unknown_key(section: str) -> str:
    """The message for a key of a settings section that is not a setting, naming the known ones."""
    return f"not a {section} setting; known: {', '.join(SECTIONS[section].model_fields)}"


def effective(project: Project | None, surface: S) -> S:
    """The settings `surface` (settings or a resource) runs with: defaults < file's section < `given()`."""
    concern = concern_of(type(surface))
    name = next(key for key, cls in CONCERNS.items() if cls is concern)
    section: Settings | None = getattr(project, name, None) if name in SECTIONS else None
    values: dict[str, Any] = {**(section.given() if section is not None else {}), **surface.given()}
    return concern.parse(values, where=name)  # type: ignore[return-value]
