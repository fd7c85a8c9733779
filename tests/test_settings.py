"""Every user setting has one source, `lightning_dagster/settings.py`: one name and one default on every
surface. Each `lightning-dagster` sub-command's flag that is a setting was generated from it (`add_flags`:
its flag, no default of its own, its help the setting's description), no flag names a setting under another
name, every field of the code location's resources is a setting with the setting's default, and no internal
dataclass of training/ or gateway/ keeps a default of its own for a setting. A failure names the surface
(command and flag, resource and field, dataclass and field) and the setting."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import re
import typing
from collections.abc import Iterator
from typing import Annotated, Any

import pytest

from lightning_dagster import settings
from lightning_dagster.cli import COMMANDS
from lightning_dagster.settings import CONCERNS, Settings, add_flags, dest_of, flag_of

# (settings class, field) of every setting, by its argparse dest and by its flag.
SETTINGS: list[tuple[type[Settings], str]] = [
    (cls, name) for cls in CONCERNS.values() for name in cls.model_fields
]
BY_DEST = {dest_of(cls, name): (cls, name) for cls, name in SETTINGS}
BY_FLAG = {flag_of(name, cls.flag_prefix): (cls, name) for cls, name in SETTINGS}

# Flags that named a setting under another name on some command before the settings were defined once. Each
# maps to the one name; a command offering one fails. (`--model-alias`: the names a gateway serves the policy
# under are the project file's `harness.model_names`, one name for the concept.)
FLAG_ALIASES: dict[str, str] = {
    "--lr": "TrainingSettings.learning_rate (--learning-rate)",
    "--group": "TrainingSettings.group_size (--group-size)",
    "--heldout": "TrainingSettings.holdout_tasks (--holdout-tasks)",
    "--timeout": "TrainingSettings.attempt_timeout_s (--attempt-timeout-s)",
    "--threads": "ServingSettings.engine_threads (--engine-threads)",
    "--upstream": "ServingSettings.upstream_url (--upstream-url)",
    "--mode": "ServingSettings.runner_mode (--runner-mode)",
    "--serving": "ServingSettings.engine_process (--engine-process)",
    "--store": "StoreSettings.url (--store-url)",
    "--policy": "GateSettings.policy_path (--policy-path)",
    "--roles": "GateSettings.roles_path (--roles-path)",
    "--model-alias": "the project file's harness.model_names (--model-names)",
}

# Settings that are never a flag, each with why; a command may only refuse one (a hidden option saying how it
# is given instead).
NEVER_FLAGS: dict[str, str] = {
    "secret": "a command line is readable by every process of the user (/proc/PID/cmdline)",
}

# Dataclass field names that are a setting's under a short name.
FIELD_ALIASES: dict[str, str] = {
    "lr": "learning_rate",
    "heldout": "holdout_tasks",
    "threads": "engine_threads",
    "serving": "engine_process",
    "timeout_s": "attempt_timeout_s",
}

# Dataclass fields named like a setting that are not one, each with why.
NOT_SETTINGS: dict[tuple[str, str], str] = {
    ("lightning_dagster.gateway.backends.CallSampling", "temperature"): (
        "one call's own temperature, 1.0 when a request names none (the OpenAI API's default); the "
        "training setting is what the runner sends for a train rollout"
    ),
    ("lightning_dagster.training.warmstart.WarmStartConfig", "lr"): (
        "the supervised warm start's own learning rate, not the RL one (`learning_rate`), and no setting"
    ),
}


# ------------------------------------------------------------------------------------------------ CLI flags


def _commands(name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`lightning-dagster NAME` and each of its sub-commands, as `main` builds them."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"lightning-dagster {name}")
    module.register(parser)
    todo = [(f"lightning-dagster {name}", parser)]
    while todo:
        path, parser = todo.pop()
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{path} {sub}", p) for sub, p in action.choices.items()]


def _generated(cls: type[Settings], name: str) -> argparse.Action:
    reference = argparse.ArgumentParser()
    add_flags(reference, cls, [name])
    return reference._actions[-1]


def _shape(action: argparse.Action) -> dict[str, Any]:
    kind = action.type
    return {
        "flags": action.option_strings,
        "dest": action.dest,
        "default": action.default,
        "help": action.help,
        "action": type(action).__name__,
        "type": getattr(kind, "__name__", kind),
        "choices": action.choices,
        "nargs": action.nargs,
        "required": action.required,
    }


def _flag_problems(command: str, parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        flags = action.option_strings
        setting = BY_DEST.get(action.dest) or next((BY_FLAG[f] for f in flags if f in BY_FLAG), None)
        if setting is not None:
            cls, name = setting
            where = f"{command} {'/'.join(flags) or action.dest}: the setting {cls.__name__}.{name}"
            if name in NEVER_FLAGS:
                if action.help != argparse.SUPPRESS:
                    problems.append(f"{where} is never a flag: {NEVER_FLAGS[name]}")
                continue
            if not flags:
                problems.append(
                    f"{where} is a positional argument; a setting is a flag, {flag_of(name, cls.flag_prefix)}"
                )
                continue
            own, generated = _shape(action), _shape(_generated(cls, name))
            differs = {key: own[key] for key in own if own[key] != generated[key]}
            if differs:
                problems.append(
                    f"{where} is declared by hand, not generated by add_flags (differs in "
                    + ", ".join(
                        f"{key} {value!r}, generated {generated[key]!r}" for key, value in differs.items()
                    )
                    + ")"
                )
        for flag in flags:
            if flag in FLAG_ALIASES:
                problems.append(
                    f"{command} {flag}: names the setting {FLAG_ALIASES[flag]} under another name"
                )
            elif flag not in BY_FLAG and (other := _under_another_prefix(flag)):
                problems.append(f"{command} {flag}: names the setting {other} under another prefix")
    return problems


def _under_another_prefix(flag: str) -> str | None:
    """`--training-steps`, `--gate-policy-path`, `--url`: a setting's flag with a concern's name before it, or
    without the prefix its concern has."""
    for cls, name in SETTINGS:
        others = [flag_of(name, prefix) for prefix in ("", *CONCERNS) if prefix != cls.flag_prefix]
        if flag in others:
            return f"{cls.__name__}.{name} ({flag_of(name, cls.flag_prefix)})"
    return None


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_that_is_a_setting_is_generated_from_it(name):
    problems = [problem for command, parser in _commands(name) for problem in _flag_problems(command, parser)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_hand_written_flag_an_alias_and_a_second_default():
    parser = argparse.ArgumentParser()
    add_flags(parser, settings.TrainingSettings, ["steps"])
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--training-seed", type=int)
    parser.add_argument("--url")
    problems = _flag_problems("cmd", parser)
    assert len(problems) == 4, problems
    assert problems[0].startswith(
        "cmd --learning-rate: the setting TrainingSettings.learning_rate is declared by hand"
    )
    assert "default 0.001, generated '==SUPPRESS=='" in problems[0]
    assert (
        problems[1]
        == "cmd --lr: names the setting TrainingSettings.learning_rate (--learning-rate) under another name"
    )
    assert (
        problems[2]
        == "cmd --training-seed: names the setting TrainingSettings.seed (--seed) under another prefix"
    )
    assert problems[3] == "cmd --url: names the setting StoreSettings.url (--store-url) under another prefix"


# ------------------------------------------------------------------------------------------------ settings


def test_setting_names_and_flags_are_unique_across_concerns():
    # A field name is the key of the project file's section, the resource field and (after the concern's
    # prefix) the flag: two concerns with one name would make `--seed` mean two things.
    seen: dict[str, str] = {}
    clashes = []
    for cls, name in SETTINGS:
        for key in {name, dest_of(cls, name)}:
            if key in seen and seen[key] != cls.__name__:
                clashes.append(f"{key}: {seen[key]} and {cls.__name__}")
            seen.setdefault(key, cls.__name__)
    assert not clashes, "\n".join(clashes)


def test_every_setting_has_help():
    missing = [f"{cls.__name__}.{name}" for cls, name in SETTINGS if not cls.model_fields[name].description]
    assert not missing, (
        "settings without a description (the help of their flag and resource field): " + ", ".join(missing)
    )


# ------------------------------------------------------------------------------------------------ resources


def test_every_resource_field_of_the_code_location_is_a_setting_with_its_default():
    from lightning_dagster.orchestration.definitions import defs
    from lightning_dagster.orchestration.resources import PipelineResource

    problems = []
    ours = {key: r for key, r in defs.resources.items() if type(r).__module__.startswith("lightning_dagster")}
    assert set(ours) == {"pipeline"}, f"resources of the code location not checked here: {sorted(ours)}"
    pipeline = ours["pipeline"]
    assert type(pipeline) is PipelineResource
    assert list(type(pipeline).model_fields) == list(CONCERNS), (
        "the pipeline resource's parts are the concerns"
    )
    for part, concern in CONCERNS.items():
        resource = getattr(pipeline, part)
        cls = type(resource)
        if concern not in cls.__mro__:
            problems.append(f"resource {cls.__name__} (pipeline.{part}) does not inherit {concern.__name__}")
            continue
        for name, field in cls.model_fields.items():
            where = f"resource {cls.__name__}.{name}"
            if name not in concern.model_fields:
                problems.append(f"{where} is not a setting of {concern.__name__}")
                continue
            setting = concern.model_fields[name]
            ours_default = field.get_default(call_default_factory=True)
            theirs = setting.get_default(call_default_factory=True)
            if ours_default != theirs or field.description != setting.description:
                problems.append(
                    f"{where}: default {ours_default!r} where the setting {concern.__name__}.{name} has {theirs!r}"
                )
        # The code location sets no value in code: a field set is one an environment variable names.
        import dagster as dg

        literal = {
            name: value for name, value in resource.given().items() if not isinstance(value, dg.EnvVar)
        }
        if literal:
            problems.append(
                f"resource {cls.__name__} of the code location sets {literal} in code: a second default"
            )
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------ dataclasses


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _setting_named(cls: type, field: str) -> str | None:
    """The setting a dataclass field stands for: its name, its name after the class's (`WarmStartConfig.
    max_steps`: `warm_start_max_steps`), or a short name of one (`lr`)."""
    names = {name: cls_.__name__ for cls_, name in SETTINGS}
    stem = _snake(re.sub(r"(Config|Settings)$", "", cls.__name__))
    for candidate in (field, f"{stem}_{field}", FIELD_ALIASES.get(field)):
        if candidate in names:
            return f"{names[candidate]}.{candidate}"
    return None


def _modules(package: str) -> Iterator[Any]:
    root = importlib.import_module(package)
    yield root
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        yield importlib.import_module(info.name)


@pytest.mark.parametrize("package", ["lightning_dagster.training", "lightning_dagster.gateway"])
def test_no_internal_dataclass_keeps_a_default_of_its_own_for_a_setting(package):
    # A setting's default lives in its settings class; a dataclass the CLI or the pipeline fills from it
    # takes the value without a default (or None, "not given"), so a caller that forgets it fails loudly
    # instead of running with a second default.
    problems = []
    for module in _modules(package):
        for cls in vars(module).values():
            if not (
                isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__
            ):
                continue
            for field in dataclasses.fields(cls):
                has_default = field.default is not dataclasses.MISSING and field.default is not None
                if not has_default and field.default_factory is dataclasses.MISSING:
                    continue
                setting = _setting_named(cls, field.name)
                if setting is None or (f"{module.__name__}.{cls.__name__}", field.name) in NOT_SETTINGS:
                    continue
                default = field.default if field.default is not dataclasses.MISSING else "(a factory)"
                problems.append(
                    f"{module.__name__}.{cls.__name__}.{field.name} defaults to {default!r}: the setting "
                    f"{setting} is its one default"
                )
    assert not problems, "\n".join(problems)


def _is_text(annotation: Any) -> bool:
    """`str`, or `str` with constraints (`settings.NonEmpty`)."""
    return annotation is str or (
        typing.get_origin(annotation) is Annotated and typing.get_args(annotation)[0] is str
    )


# Every text setting (a string, or each string of a list) with the value that means nothing there.
TEXTS = [
    (cls, name, [""] if typing.get_origin(field.annotation) is list else "")
    for cls, name in SETTINGS
    for field in [cls.model_fields[name]]
    if _is_text(field.annotation)
    or (typing.get_origin(field.annotation) is list and _is_text(typing.get_args(field.annotation)[0]))
]


@pytest.mark.parametrize(("cls", "name", "empty"), TEXTS, ids=[f"{c.__name__}.{n}" for c, n, _ in TEXTS])
def test_an_empty_string_setting_is_refused_by_name_unless_it_says_what_empty_means(cls, name, empty):
    """ "" is refused, naming the setting, wherever it means nothing; a setting whose "" means "unset" says
    what it then means in its description ("empty: ...") and takes it."""
    if empty == "" and "empty" in (cls.model_fields[name].description or ""):
        assert getattr(cls.parse({name: ""}), name) == ""
        return
    where = f"{name}.0" if isinstance(empty, list) else name
    with pytest.raises(
        settings.SettingsError, match=rf"^training\.{re.escape(where)}: String should have at least 1"
    ):
        cls.parse({name: empty}, where="training")
