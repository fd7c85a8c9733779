"""Without vLLM: where VllmServer looks for the vLLM venv and what it says when there is none or it is not
one, and the content hash that names an adapter snapshot."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from lightning_dagster.engine.vllm_server import (
    DEFAULT_PYTHON,
    PYTHON_ENV,
    AdapterNotVerified,
    VllmServer,
    VllmStartError,
    VllmUnavailable,
    adapter_hash,
    vllm_python,
)


def test_the_interpreter_is_the_argument_else_the_environment_else_the_repos_venv(monkeypatch, tmp_path):
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    assert vllm_python() == Path(sys.executable)
    with pytest.raises(VllmUnavailable, match=f"no vLLM interpreter at {tmp_path}/nope: run `make vllm`"):
        vllm_python(tmp_path / "nope")  # the argument wins over the environment
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(VllmUnavailable, match="missing"):
        VllmServer(tmp_path, name="x")
    monkeypatch.delenv(PYTHON_ENV)
    if not DEFAULT_PYTHON.exists():
        with pytest.raises(VllmUnavailable, match=str(DEFAULT_PYTHON)):
            vllm_python()
    else:
        assert vllm_python() == DEFAULT_PYTHON


def test_an_adapter_hash_covers_every_files_name_and_bytes(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"\1\2\3")
    digest = adapter_hash(folder)
    shutil.copytree(folder, tmp_path / "copy")
    assert adapter_hash(tmp_path / "copy") == digest
    (tmp_path / "copy" / "adapter_model.safetensors").write_bytes(b"\1\2\4")
    assert adapter_hash(tmp_path / "copy") != digest
    (tmp_path / "copy" / "adapter_model.safetensors").write_bytes(b"\1\2\3")
    (tmp_path / "copy" / "adapter_config.json").rename(tmp_path / "copy" / "config.json")
    assert adapter_hash(tmp_path / "copy") != digest
    with pytest.raises(AdapterNotVerified, match="no adapter files"):
        adapter_hash(tmp_path / "empty")


def test_a_server_that_exits_at_start_fails_with_its_log(tmp_path):
    server = VllmServer(tmp_path, python=sys.executable, expected_hash="0" * 64)  # a python without vLLM
    with pytest.raises(VllmStartError, match="(?s)exited during start-up.*No module named 'vllm'"):
        server.start()
    assert not server.alive


def test_a_lora_rank_vllm_does_not_offer_is_served_under_the_next_one_it_does(vllm_interpreter, tmp_path):
    from lightning_dagster.engine.vllm_server import VllmError, VllmServer, served_lora_rank

    assert [served_lora_rank(r) for r in (1, 2, 4, 8, 9, 512)] == [1, 8, 8, 8, 16, 512]
    with pytest.raises(VllmError, match="largest --max-lora-rank"):
        served_lora_rank(513)
    command, env = VllmServer(tmp_path, python=vllm_interpreter, max_lora_rank=4).command_line()
    assert command[command.index("--max-lora-rank") + 1] == "8"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
