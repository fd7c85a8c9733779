"""Resolve what a project file points at: `module:function` references and a command's program."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

# The interpreter running lightning-dagster already has `openai` installed; a `python` found on PATH may not.
PYTHON_NAMES = ("python", "python3")


def _put_on_path(root: Path) -> None:
    # for the life of the process, as `python script.py` does: the harness may import siblings later
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


def _forget_shadowed(module_name: str, root: Path) -> None:
    """Drop a cached module of the same name from another folder (two projects may have an `agent.py`)."""
    top = module_name.split(".")[0]
    cached: ModuleType | None = sys.modules.get(top)
    local = [root / f"{top}.py", root / top / "__init__.py"]
    if cached is None or not any(p.exists() for p in local):
        return
    cached_file = getattr(cached, "__file__", None)
    if cached_file and Path(cached_file).resolve() in [p.resolve() for p in local]:
        return
    for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
        del sys.modules[name]


def resolve_reference(ref: str, root: Path) -> Any:
    """The object `module:attr` names (`attr` may be dotted), importing modules from `root` first."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise ValueError(f"expected 'module:function', got {ref!r}")
    _put_on_path(root)
    _forget_shadowed(module_name, root)
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise ValueError(f"no module {module_name!r} in {root} or the installed packages") from None
        raise ValueError(f"module {module_name!r} does not import: {err}") from None
    except Exception as err:  # any failure while running the user's module is a broken reference
        raise ValueError(f"module {module_name!r} does not import: {type(err).__name__}: {err}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


def resolve_callable(ref: str, root: Path) -> Any:
    target = resolve_reference(ref, root)
    if not callable(target):
        raise ValueError(f"{ref!r} is not callable ({type(target).__name__})")
    return target


def resolve_agent_class(ref: str, root: Path) -> type:
    target = resolve_reference(ref, root)
    if not isinstance(target, type) or not callable(getattr(target, "run", None)):
        raise ValueError(f"{ref!r} is not a class with a run() method")
    return target


SCRIPT_SUFFIXES = (".py", ".mjs", ".cjs", ".js", ".ts", ".mts", ".sh", ".rb", ".pl")
INLINE_CODE = ("-c", "-e", "--eval", "-p", "--print")  # interpreter options whose next argument is code


def missing_scripts(command: tuple[str, ...], root: Path) -> list[str]:
    """The arguments after a command's program that look like a script file and do not exist in `root`."""
    return [
        arg
        for before, arg in zip(command, command[1:], strict=False)
        if (arg.endswith(SCRIPT_SUFFIXES) or "/" in arg or os.sep in arg)
        and before not in INLINE_CODE
        and not (arg.startswith("-") or "://" in arg or any(c.isspace() for c in arg))
        and not (root / Path(arg).expanduser()).exists()
    ]


def resolve_program(program: str, root: Path) -> str:
    """The absolute path of a command's program: a file relative to `root`, else a name on PATH."""
    if program in PYTHON_NAMES:
        return sys.executable
    local = (root / Path(program).expanduser()).resolve()
    if os.sep in program or "/" in program or local.exists():
        if not local.is_file():
            raise ValueError(f"program {program!r} not found ({local} does not exist)")
        if not os.access(local, os.X_OK):
            raise ValueError(f"program {local} is not executable (chmod +x, or name its interpreter first)")
        return str(local)
    found = shutil.which(program)
    if found is None:
        raise ValueError(f"program {program!r} not found on PATH or in {root}")
    return found
