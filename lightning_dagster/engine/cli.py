"""`lightning-dagster engine build|info`: build the tiny base model (its tokenizer trained on the text the
example agents exchange), or describe a model directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_dagster.settings import TrainingSettings, add_flags, from_flags


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="engine_command", metavar="COMMAND")
    build = sub.add_parser(
        "build", help="build the tiny base model and a tokenizer trained on the harnesses' text (no download)"
    )
    build.add_argument("--out", required=True, type=Path, help="directory to save the model into")
    add_flags(build, TrainingSettings, ["seed"])
    build.add_argument(
        "--architecture", default="qwen2", help="the model's shape: qwen2 (default), llama or gpt2"
    )
    build.set_defaults(handler=_build)
    info = sub.add_parser("info", help="describe a model directory as JSON")
    info.add_argument("dir", type=Path)
    info.set_defaults(handler=_info)


def _build(args: argparse.Namespace) -> int:
    from lightning_dagster.engine.build import build_base_model, default_corpus

    seed = from_flags(TrainingSettings(), args).seed
    out = build_base_model(args.out, corpus=default_corpus(), seed=seed, architecture=args.architecture)
    print(json.dumps(describe(out), indent=2))
    return 0


def _info(args: argparse.Namespace) -> int:
    if not (args.dir / "config.json").is_file():
        print(f"error: {args.dir} is not a model directory (no config.json)")
        return 2
    print(json.dumps(describe(args.dir), indent=2))
    return 0


def describe(model_dir: Path) -> dict:
    """Architecture, size, special token ids and weights hash of a model directory."""
    from lightning_dagster.engine.build import checkpoint_hash
    from lightning_dagster.engine.chat import MARKER_TOKENS
    from lightning_dagster.engine.engine import Engine

    engine = Engine(model_dir)
    tok = engine.tokenizer
    return {
        "dir": str(Path(model_dir).resolve()),
        "model_type": engine.model.config.model_type,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "vocab_size": engine.vocab_size,
        "max_length": engine.max_length,
        "eos_token_ids": sorted(engine.eos_token_ids),
        "pad_token_id": engine.pad_token_id,
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens},
        "tool_call_markers": {t: i for t, i in tok.get_vocab().items() if t in MARKER_TOKENS},
        "has_chat_template": bool(tok.chat_template),
        "checkpoint_hash": checkpoint_hash(model_dir),
    }
