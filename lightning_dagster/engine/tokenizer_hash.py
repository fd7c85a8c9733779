"""A tokenizer's fingerprint: sha256 over what decides which token an id is and how text becomes ids.

Hashed as canonical JSON: the backend tokenizer's definition (not its padding and truncation, runtime
settings), the special tokens and their ids, and the chat template; a trainer's checkpoint keeps its
parent's. Without a fast backend (no `tokenizer.json`) the vocabulary is hashed instead: merges not covered.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

PREFIX = "sha256:"


def _backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])}
    spec = json.loads(backend.to_str())
    for runtime in ("version", "truncation", "padding"):
        spec.pop(runtime, None)
    merges = (spec.get("model") or {}).get("merges")
    if merges and isinstance(merges[0], str):  # older `tokenizers` write "a b", newer ["a", "b"]
        spec["model"]["merges"] = [m.split(" ", 1) for m in merges]
    return spec


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """`sha256:<hex>` of a loaded Hugging Face tokenizer (see the module docstring for what it covers)."""
    content = {
        "backend": _backend(tokenizer),
        "special_tokens": tokenizer.special_tokens_map,  # key order: sort_keys below
        "special_ids": sorted(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True)),
        "added": sorted(
            (int(i), t.content, bool(t.special)) for i, t in tokenizer.added_tokens_decoder.items()
        ),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return PREFIX + hashlib.sha256(blob.encode()).hexdigest()


def tokenizer_fingerprint_of(model_dir: Path | str) -> str:
    """The fingerprint of the tokenizer saved in `model_dir` (a checkpoint or a tokenizer folder)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(model_dir)))
