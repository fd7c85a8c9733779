"""VllmServer against a real vLLM CPU server (one per module: a start costs ~30-70 s): token-in completions
with exact ids and the logprobs of what was sampled, weight reloads that change what is served and count only
when verified by hash, LoRA adapters served and verified by content hash, and a dead server that gives a
named error and leaves no process behind, however its owner or the server itself ended."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_dagster.engine.build import checkpoint_hash, save_weights
from lightning_dagster.engine.sampling import _outside_top_p
from lightning_dagster.engine.vllm_server import (
    AdapterNotVerified,
    LoraNotEnabled,
    VllmServer,
    VllmServerDied,
    VllmStartError,
    WeightsNotVerified,
    adapter_hash,
)

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "seed": 11}


@pytest.fixture(scope="module")
def server(vllm_interpreter, checkpoints, tmp_path_factory):
    folder, expected = checkpoints["base"]
    with VllmServer(folder, python=vllm_interpreter, expected_hash=expected, max_lora_rank=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused")


@pytest.fixture(scope="module")
def prompt(checkpoints) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["base"][0])
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 times 7?"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]


@pytest.fixture(scope="module")
def first_sample(server, client, prompt) -> tuple[list[int], list[float]]:
    """A seeded sample of the freshly started server (later compared with one after reloads)."""
    return _sample(client, server.name, prompt)


def _sample(client, model: str, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], list[float]]:
    choice = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, logprobs=0, extra_body={"return_token_ids": True},
        **SAMPLING,
    ).choices[0]  # fmt: skip
    assert choice.model_extra["prompt_token_ids"] == prompt  # token-in: the ids sent are the ids served
    return choice.model_extra["token_ids"], choice.logprobs.token_logprobs


def _scored(client, model: str, ids: list[int]) -> torch.Tensor:
    """The served model's logprob of each of `ids` after the ones before it (prompt_logprobs, T=1)."""
    choice = client.completions.create(
        model=model, prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    ).choices[0]
    return torch.tensor(
        [next(iter(d.values()))["logprob"] for d in choice.model_extra["prompt_logprobs"][1:]]
    )


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def _reference(folder: Path, ids: list[int], adapter: Path | None = None) -> torch.Tensor:
    """transformers' logprob of each of `ids` after the ones before it, for the checkpoint (+ adapter)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    logp = torch.log_softmax(_logits(model, ids)[:-1], -1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_token_in_completion_returns_ids_and_the_logprobs_of_what_was_sampled(
    checkpoints, first_sample, prompt
):
    ids, logprobs = first_sample
    assert len(ids) == len(logprobs) >= 1 and all(lp <= 0 for lp in logprobs)
    # the reference: transformers' logits, under the request's temperature and top-p, renormalised
    model = AutoModelForCausalLM.from_pretrained(checkpoints["base"][0], dtype=torch.float32)
    logits = _logits(model, prompt + ids)[len(prompt) - 1 : -1]
    scaled = logits / SAMPLING["temperature"]
    outside = _outside_top_p(scaled, torch.full((len(ids),), SAMPLING["top_p"]))
    processed = torch.log_softmax(torch.log_softmax(scaled, -1).masked_fill(outside, float("-inf")), -1)
    raw = torch.log_softmax(logits, -1)
    index = torch.tensor(ids)[:, None]
    got = torch.tensor(logprobs, dtype=torch.float64)
    assert torch.allclose(got, processed.gather(1, index).squeeze(1), atol=1e-3)
    assert (got - raw.gather(1, index).squeeze(1)).abs().max() > 0.05  # vLLM's default mode would give these


def test_a_seeded_request_replays_the_same_ids_and_logprobs(server, client, prompt, first_sample):
    assert _sample(client, server.name, prompt) == first_sample


def test_concurrent_seeded_requests_longer_than_a_steps_budget_are_all_served(server, client, prompt):
    """Seeded prompts whose prefills do not fit one engine step together (as a rollout batch's do): with
    vLLM's chunked prefill the CPU engine died on them, failing every request in flight."""
    from concurrent.futures import ThreadPoolExecutor

    long_prompt = (prompt * (160 // len(prompt) + 1))[:160]

    def call(seed: int) -> list[int]:
        return client.completions.create(  # a first token of its own: no prompt is in the prefix cache
            model=server.name, prompt=[100 + seed, *long_prompt], max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"return_token_ids": True},
        ).choices[0].model_extra["token_ids"]  # fmt: skip

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(call, range(32)))
    assert all(answers) and server.alive
    assert call(5) == answers[5]  # and each seed still replays


def test_start_serves_the_model_folder_verified_by_its_checkpoint_hash(server, checkpoints):
    folder, expected = checkpoints["base"]
    assert server.served_weights().hash == expected
    server.verify_weights(expected)
    with pytest.raises(WeightsNotVerified, match="not " + checkpoints["other"][1]):
        server.verify_weights(checkpoints["other"][1])


def test_reload_serves_the_other_checkpoint_verified_and_back(
    server, client, checkpoints, prompt, first_sample
):
    (base, base_hash), (other, other_hash) = checkpoints["base"], checkpoints["other"]
    ids = prompt + first_sample[0]
    assert server.reload_weights(other, other_hash) == other_hash
    served = server.served_weights()
    assert (served.hash, served.path) == (other_hash, str(other.resolve()))
    server.verify_weights(other_hash)
    with pytest.raises(WeightsNotVerified):
        server.verify_weights(base_hash)
    # what is computed is the other checkpoint, LM head included (vLLM's CPU reload alone keeps a tied LM
    # head computing with the previous embedding, which scores these ids ~0.5 nats off)
    scored = _scored(client, server.name, ids).double()
    assert (scored - _reference(other, ids)).abs().max() < 1e-4
    assert (scored - _reference(base, ids)).abs().max() > 0.05
    assert server.reload_weights(base, base_hash) == base_hash
    again_ids, again_logprobs = _sample(client, server.name, prompt)
    assert again_ids == first_sample[0]  # exact; logprobs within the engine/trainer gap TIS corrects
    assert torch.allclose(torch.tensor(again_logprobs), torch.tensor(first_sample[1]), atol=1e-3)


@pytest.mark.parametrize("expected", ["another checkpoint's hash", "a made-up hash"])
def test_a_reload_that_is_not_the_expected_checkpoint_is_refused(server, checkpoints, expected):
    (base, base_hash), (other, other_hash) = checkpoints["base"], checkpoints["other"]
    wanted = base_hash if expected == "another checkpoint's hash" else "0" * 64
    with pytest.raises(WeightsNotVerified, match=f"hash to {other_hash}, not {wanted}"):
        server.reload_weights(other, wanted)
    served = server.served_weights()
    assert served.hash is None and other_hash in served.error  # no rollout can count on these weights
    with pytest.raises(WeightsNotVerified, match="nothing verified"):
        server.verify_weights(other_hash)
    assert server.reload_weights(base, base_hash) == base_hash


def test_a_checkpoint_missing_tensors_is_refused_though_its_hash_matches(server, checkpoints, tmp_path):
    (base, base_hash), (other, _) = checkpoints["base"], checkpoints["other"]
    partial = tmp_path / "partial"
    shutil.copytree(other, partial)
    tensors = load_file(partial / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_weights(tensors, partial / "model.safetensors")
    with pytest.raises(
        WeightsNotVerified, match=r"1 parameters were not loaded: \['model.layers.3.mlp.down_proj"
    ):
        server.reload_weights(partial, checkpoint_hash(partial))
    assert server.served_weights().hash is None
    assert server.reload_weights(base, base_hash) == base_hash


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory) -> Path:
    """A LoRA adapter of the base model with random nonzero weights (peft's default B=0 changes nothing)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(checkpoints["base"][0], dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tuned = get_peft_model(model, config)
    folder = tmp_path_factory.mktemp("adapter") / "tuned"
    tuned.save_pretrained(folder)
    return folder


def test_a_lora_adapter_is_served_under_its_name_and_verified(server, client, checkpoints, adapter, prompt):
    digest = adapter_hash(adapter)
    snapshot = server.load_adapter("tuned", adapter, digest)
    assert server.adapters()["tuned"] == str(snapshot) and snapshot.name == digest
    server.verify_adapter("tuned", digest)
    ids = prompt + [int(i) for i in range(40, 52)]
    tuned = _scored(client, "tuned", ids).double()
    base = checkpoints["base"][0]
    assert (tuned - _reference(base, ids, adapter)).abs().max() < 1e-3
    assert (tuned - _reference(base, ids)).abs().max() > 0.05
    assert (_scored(client, server.name, ids).double() - _reference(base, ids)).abs().max() < 1e-4
    # a base reload drops the worker's adapters; the next request loads it again from its snapshot
    server.reload_weights(base, checkpoints["base"][1])
    assert torch.allclose(_scored(client, "tuned", ids).double(), tuned, atol=1e-5)

    with pytest.raises(AdapterNotVerified, match="not loaded"):
        server.load_adapter("wrong", adapter, "0" * 64)
    assert "wrong" not in server.adapters()
    with pytest.raises(AdapterNotVerified, match="not the snapshot of"):
        server.verify_adapter("tuned", "0" * 64)
    weights = snapshot / "adapter_model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")  # the files it is served from changed
    with pytest.raises(AdapterNotVerified, match="changed"):
        server.verify_adapter("tuned", digest)
    server.unload_adapter("tuned")
    with pytest.raises(AdapterNotVerified, match="no adapter named 'tuned'"):
        server.verify_adapter("tuned", digest)


def test_adapters_need_a_server_started_for_lora(checkpoints, vllm_interpreter, adapter):
    with pytest.raises(LoraNotEnabled):
        VllmServer(checkpoints["base"][0], python=vllm_interpreter).load_adapter("x", adapter, "0" * 64)


def test_a_server_not_ready_in_time_is_stopped_with_its_log(checkpoints, vllm_interpreter):
    server = VllmServer(checkpoints["base"][0], python=vllm_interpreter, start_timeout=2)
    with pytest.raises(VllmStartError, match="not ready within 2 s"):
        server.start()
    assert not server.alive and not psutil.pid_exists(server.pid)  # the launcher ends after its process group


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False


OWNER = """
import sys
from lightning_dagster.engine.vllm_server import VllmServer
VllmServer(sys.argv[1], python=sys.argv[2], work_dir=sys.argv[3]).start()
"""


def test_the_server_ends_with_its_owner_even_a_killed_one(checkpoints, vllm_interpreter, tmp_path):
    """The owner's whole process group is SIGKILLed (as a job runner ends a job), mid-start."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", OWNER, str(checkpoints["base"][0]), str(vllm_interpreter), str(tmp_path)]
    owner = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        tree: list[psutil.Process] = []
        while owner.poll() is None and time.monotonic() < deadline and not _engine_in(tree):
            time.sleep(0.5)  # the engine core runs once the server is well into its start
            tree = psutil.Process(owner.pid).children(recursive=True)
        assert _engine_in(tree), "the server never started its engine"
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _gone([p.pid for p in tree], within=30), "server processes outlived their owner"
    finally:
        owner.kill()


def _engine_in(tree: list[psutil.Process]) -> bool:
    return any("EngineCore" in _name(p) for p in tree)


def _name(process: psutil.Process) -> str:
    try:
        return process.name() + " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_a_killed_server_gives_a_named_error_not_a_hang(server):
    """Last in the module: it kills the module's server."""
    launcher = psutil.Process(server.pid)
    tree = launcher.children(recursive=True)
    api = next(p for p in tree if "api_server" in " ".join(p.cmdline()))
    api.send_signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(VllmServerDied, match="not running"):
        server.served_weights()
    assert time.monotonic() - started < 10
    assert _gone([launcher.pid, *(p.pid for p in tree)], within=15), (
        "the engine processes outlived the server"
    )
    with pytest.raises(VllmServerDied):
        server.reload_weights(Path("/nonexistent"), "0" * 64)
