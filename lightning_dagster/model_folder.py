"""What a model or tokenizer folder needs before anything is loaded from it, checked from its files alone
(no torch or transformers import), so a project file or a command can refuse a folder up front."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelFolderError(ValueError):
    """A model or tokenizer folder that cannot serve chats: the message names the folder and what it lacks."""


# Any of these is a tokenizer saved by `save_pretrained` (fast, byte-level BPE, WordPiece or SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _json_file(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return None, f"{path.name} is not readable JSON ({err})"


def model_folder_problems(folder: Path | str, *, weights: bool = True) -> list[str]:
    """What keeps `folder` from serving chats, checked from its files without loading anything: a model
    (`weights`) needs a readable config.json; every folder a tokenizer and a chat template. Empty: usable."""
    folder = Path(folder)
    if not folder.is_dir():
        return ["not a directory" if folder.exists() else "does not exist"]
    problems = []
    if weights:
        if not (folder / "config.json").is_file():
            problems.append("has no config.json (not a Hugging Face model folder)")
        else:
            problems += filter(None, [_json_file(folder / "config.json")[1]])
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
        return problems
    template = any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json"))
    if not template and (folder / "tokenizer_config.json").is_file():
        settings, problem = _json_file(folder / "tokenizer_config.json")
        problems += filter(None, [problem])
        template = isinstance(settings, dict) and bool(settings.get("chat_template"))
    if not template and not problems:
        problems.append(
            "the tokenizer has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)"
        )
    return problems


def check_model_folder(folder: Path | str, *, weights: bool = True) -> Path:
    """`folder`, or ModelFolderError naming every problem `model_folder_problems` finds."""
    problems = model_folder_problems(folder, weights=weights)
    if problems:
        raise ModelFolderError(f"{folder}: {'; '.join(problems)}")
    return Path(folder)
