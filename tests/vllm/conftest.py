"""The checkpoints the vLLM tests serve: two tiny Qwen2-shaped models the engine builds (seeds 0 and 1: same
tokenizer, other weights), and the vLLM interpreter, without which the tests that need one are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dagster.engine.build import build_base_model, checkpoint_hash, default_corpus
from lightning_dagster.engine.vllm_server import VllmUnavailable, vllm_python


@pytest.fixture(scope="session")
def vllm_interpreter() -> Path:
    try:
        return vllm_python()
    except VllmUnavailable as exc:
        pytest.skip(f"vLLM venv not found: {exc}")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (folder, checkpoint_hash) for `base` (seed 0) and `other` (seed 1)."""
    root = tmp_path_factory.mktemp("vllm-models")
    built = {}
    for name, seed in (("base", 0), ("other", 1)):
        folder = build_base_model(root / name, corpus=default_corpus(), seed=seed)
        built[name] = (folder, checkpoint_hash(folder))
    return built
