"""The project file `lightning-dagster.yaml`: `load_project(path)` resolves every path and `module:function`
it names, so a project that loads can run; every problem is a `ProjectError` naming file and dotted key."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lightning_dagster.project.errors import ProjectError
from lightning_dagster.project.references import resolve_agent_class, resolve_callable, resolve_program
from lightning_dagster.project.sections import (
    RENAMED,
    SECTIONS,
    GateSection,
    ServingSection,
    existing_path,
    unknown_key,
)
from lightning_dagster.settings import TrainingSettings

PROJECT_FILE = "lightning-dagster.yaml"
# The keys that name a path, relative to the project folder (`tasks.path` must lie inside it).
PATH_KEYS = (
    ("model", "path"),
    ("model", "tokenizer"),
    ("model", "warm_start"),
    ("gate", "policy_path"),
    ("gate", "roles_path"),
)
HARNESS_KINDS = ("command", "python", "agl")
Split = Literal["train", "holdout", "protected", "canary"]
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
VALUE_ERROR = "Value error, "


def _root(info: ValidationInfo) -> Path:
    return info.context["root"]


def _existing(value: Path, info: ValidationInfo, *, directory: bool = False) -> Path:
    return existing_path(value, _root(info), directory=directory)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Harness(_Section):
    """How to run the agent: one of `command` (a program run in the project folder), `python`
    (`module:function` called in-process with the task and an OpenAI client) or `agl` (`module:Class`)."""

    command: tuple[str, ...] | None = None
    python: str | None = None
    agl: str | None = None
    expected_spans: tuple[str, ...] = ("llm", "reward")
    env_map: dict[str, str] = Field(default_factory=dict)
    prepare: str | None = None
    verify: str | None = None
    model_names: tuple[str, ...] = ()  # given, the only names served besides the model's own (else 404)
    # Variables a `command` harness inherits beyond the allowlist, e.g. an API key (never LD_*, MLFLOW_*).
    env_passthrough: tuple[str, ...] = ()
    # Of a `command` harness's stdout, and of its stderr, per attempt: first and last halves kept.
    max_output_bytes: int = Field(4 * 1024 * 1024, ge=1024)

    @field_validator("command")
    @classmethod
    def _program_exists(cls, value: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value or not value[0].strip():
            raise ValueError("needs at least the program to run")
        if any("\x00" in part for part in value):
            raise ValueError("an argument contains a NUL character, which no program can receive")
        return (resolve_program(value[0], _root(info)), *value[1:])

    @field_validator("python", "prepare", "verify", "agl")
    @classmethod
    def _resolves(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            (resolve_agent_class if info.field_name == "agl" else resolve_callable)(value, _root(info))
        return value

    @field_validator("env_passthrough")
    @classmethod
    def _passable(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from lightning_dagster.runner.execute import check_passthrough

        return check_passthrough(value)

    @field_validator("model_names")
    @classmethod
    def _names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name.strip() or len(name) > 256 or "\x00" in name:
                raise ValueError(f"{name!r} is not a model name (1-256 characters, no NUL)")
        return value

    @field_validator("expected_spans")
    @classmethod
    def _span_families(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or any(not family.strip() for family in value):
            raise ValueError("needs at least one non-empty span family")
        if len(set(value)) != len(value):
            raise ValueError(f"lists a span family twice: {list(value)}")
        return value

    @field_validator("env_map")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [name for name in value if not ENV_NAME.match(name)]
        if bad:
            raise ValueError(f"not environment variable names: {', '.join(map(repr, bad))}")
        return value

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> Harness:
        given = [kind for kind in HARNESS_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            got = f" (got {', '.join(given)})" if given else ""
            raise ValueError(f"give exactly one of {', '.join(HARNESS_KINDS)}{got}")
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in HARNESS_KINDS if getattr(self, kind) is not None)


class Tasks(_Section):
    """The tasks file and its columns; the split is a column (default `split`) or `split_fractions`."""

    path: Path
    id_column: str = "task_id"
    family_column: str = "family"
    split_column: str | None = None
    split_fractions: dict[Split, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_split_column(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("split_column") is None
            and data.get("split_fractions") is None
        ):
            return {**data, "split_column": "split"}
        return data

    @field_validator("path")
    @classmethod
    def _file_exists(cls, value: Path, info: ValidationInfo) -> Path:
        return _existing(value, info)

    @field_validator("split_fractions")
    @classmethod
    def _fractions(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        bad = {name: share for name, share in value.items() if not 0 <= share <= 1}
        if bad:
            raise ValueError(f"fractions must be between 0 and 1, got {bad}")
        total = sum(value.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"fractions must sum to 1, they sum to {total:g}")
        return value

    @model_validator(mode="after")
    def _one_split_source(self) -> Tasks:
        if self.split_column is not None and self.split_fractions is not None:
            raise ValueError("give split_column or split_fractions, not both")
        return self


class Model(_Section):
    """The policy: a Hugging Face causal-LM folder (`path`), the `tokenizer` of `serving.upstream_url`'s
    model, or neither (embedded); `warm_start`: demonstrations (JSONL) the first parent learns before RL."""

    path: Path | None = None
    tokenizer: Path | None = None
    warm_start: Path | None = None

    @field_validator("path", "tokenizer")
    @classmethod
    def _folder_exists(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        # The file checks only (transformers is not imported): what serving the folder would find first.
        from lightning_dagster.model_folder import model_folder_problems

        folder = _existing(value, info, directory=True)
        problems = model_folder_problems(folder, weights=info.field_name == "path")
        if problems:
            raise ValueError(f"{folder}: {'; '.join(problems)}")
        return folder

    @field_validator("warm_start")
    @classmethod
    def _demos_exist(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else _existing(value, info)

    @model_validator(mode="after")
    def _one_source(self) -> Model:
        if self.path is not None and self.tokenizer is not None:
            raise ValueError(
                "tokenizer goes with an upstream server (serving.upstream_url); a path has its own"
            )
        return self


class Project(_Section):
    """A validated project: `file`, its folder `root` (relative paths' base), and its settings sections."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    harness: Harness
    tasks: Tasks
    reward: str | None = None
    model: Model | None = None
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    serving: ServingSection = Field(default_factory=ServingSection)
    gate: GateSection = Field(default_factory=GateSection)
    _file: Path = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        self._file = context["file"]

    @property
    def file(self) -> Path:
        return self._file

    @property
    def root(self) -> Path:
        return self._file.parent

    @field_validator("reward")
    @classmethod
    def _judge(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            resolve_callable(value, _root(info))
        return value

    def model_source_problems(self) -> list[tuple[str, str]]:
        """What is wrong with the model source the file names, as (dotted key, message)."""
        model, upstream = self.model or Model(), self.serving.upstream_url
        if upstream and model.path is not None:
            return [("serving.upstream_url", "give at most one of model.path, serving.upstream_url")]
        if upstream and model.tokenizer is None:
            problem = "serving.upstream_url needs it: the folder of the served model's tokenizer"
            return [("model.tokenizer", problem)]
        return []


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives one key twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: the keys it brings may be given again here, that is its point
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict):
                continue  # unhashable: the base loader names it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors():
        key = ".".join(str(part) for part in e["loc"] if part != "[key]")
        message = e["msg"]
        if e["type"] == "missing":
            message = "missing key"
        elif e["type"] == "extra_forbidden" and len(e["loc"]) == 2 and e["loc"][0] in SECTIONS:
            message = unknown_key(str(e["loc"][0]))
        elif e["type"] == "extra_forbidden":
            message = "unknown key"
        elif message.startswith(VALUE_ERROR):
            message = message[len(VALUE_ERROR) :]
        problems.append((key, message))
    return problems


def find_project_file(path: Path | str | None = None) -> Path:
    """The project file: `path`, `path/lightning-dagster.yaml` for a folder, else the working directory's."""
    candidate = Path.cwd() if path is None else Path(path)
    if candidate.is_dir():
        candidate = candidate / PROJECT_FILE
    return candidate.resolve()


def load_project(path: Path | str | None = None) -> Project:
    """Parse and validate a project file (see `find_project_file`); raises ProjectError."""
    file = find_project_file(path)
    try:
        text = file.read_text()
    except OSError as err:
        hint = " (create one with `lightning-dagster init DIR`)" if file.name == PROJECT_FILE else ""
        raise ProjectError(file, [("", f"cannot read the project file: {err.strerror}{hint}")]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ProjectError(file, [("", f"not valid YAML: {err}")]) from None
    if not isinstance(data, dict):
        raise ProjectError(file, [("", "expected a mapping with the keys name, harness and tasks")])
    problems = _renamed(data)
    try:
        project = Project.model_validate(data, context={"root": file.parent, "file": file})
    except ValidationError as err:
        raise ProjectError(file, problems + _problems(err)) from None
    problems += project.model_source_problems()
    if problems:
        raise ProjectError(file, problems)
    return project


def _renamed(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Each `RENAMED` key the file still gives, as a problem naming the new key (taken out of `data`)."""
    problems = []
    for keys, new in RENAMED.items():
        *parents, last = keys
        section: Any = data
        for part in parents:
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict) and last in section:
            del section[last]
            problems.append((".".join(keys), f"renamed: give it as {new}"))
    return problems
