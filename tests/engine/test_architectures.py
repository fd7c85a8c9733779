"""Qwen2-, Llama- and GPT-2-shaped models built from configs (no download), each with its own tokenizer and
chat template, go the whole way: saved and reloaded through `from_pretrained`, sampled with exact logprobs
(batched, left-padded, prefix-cached, joining a running batch), served by the gateway with token-in (or, under
a template that rewrites earlier turns, the counted fallback), and trained with a first-update ratio of 1."""

from __future__ import annotations

import dataclasses
import math
import time

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lightning_dagster.cli import main
from lightning_dagster.engine import BatchingEngine, Engine, SamplingParams, build_base_model
from lightning_dagster.engine.build import CALCULATOR_TOOL, UnknownArchitecture
from lightning_dagster.gateway import EngineBackend
from lightning_dagster.gateway.tokenin import closing_tokens
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.settings import TrainingSettings
from lightning_dagster.store import Store
from lightning_dagster.training.advantages import Advantages
from lightning_dagster.training.configs import trainer_config
from lightning_dagster.training.trainer import Trainer, collate, response_logprobs
from lightning_dagster.training.transitions import merge_calls
from tests.gateway.conftest import ADMIN, Gateway, _serve

SHAPES = ["qwen2", "llama", "gpt2"]
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# Llama-style, but the system prompt and tools travel with the latest non-assistant turn (as Mistral's
# templates carry them in the last user turn): every new turn re-renders the earlier ones.
REWRITING_TEMPLATE = r"""
{%- set ns = namespace(system=none, start=0, last=-1) -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.system = messages[0].content -%}{%- set ns.start = 1 -%}
{%- endif -%}
{%- for message in messages -%}{%- if message.role != 'assistant' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- '<|begin_of_text|>' -}}
{%- for message in messages[ns.start:] -%}
    {%- if loop.index0 + ns.start == ns.last and (ns.system or tools) -%}
        {{- '<|start_header_id|>system<|end_header_id|>\n\n' + (ns.system or '') -}}
        {%- for tool in tools or [] -%}{{- '\n' + (tool.function | tojson) -}}{%- endfor -%}
        {{- '<|eot_id|>' -}}
    {%- endif -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content or '') -}}
    {%- for call in message.tool_calls or [] -%}
        {{- '<tool_call>' + (call.function | tojson) + '</tool_call>' -}}
    {%- endfor -%}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""
HEADERS = {
    "qwen2": "<|im_start|>assistant\n",
    "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gpt2": "<|assistant|>\n",
}


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return training_corpus(seed=0)


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus):
    """Every shape, built once for the module; plus the Llama build under the rewriting template."""
    out = {}
    for arch in SHAPES:
        out[arch] = build_base_model(
            tmp_path_factory.mktemp(arch), corpus=corpus, seed=0, architecture=arch, shape=SMALL
        )
    rewriting = build_base_model(
        tmp_path_factory.mktemp("rewriting"), corpus=corpus, seed=0, architecture="llama", shape=SMALL
    )
    tok = AutoTokenizer.from_pretrained(rewriting)
    tok.chat_template = REWRITING_TEMPLATE
    tok.save_pretrained(rewriting)
    out["llama-rewriting"] = rewriting
    return out


@pytest.fixture(scope="module")
def engines(built) -> dict[str, Engine]:
    return {name: Engine(path) for name, path in built.items()}


def render_fn(engine: Engine):
    return lambda m, t, g: engine.render(m, t, add_generation_prompt=g)


def teacher_forced(
    engine: Engine, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, one unpadded row, no cache."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0]
    logp = torch.log_softmax(logits.float() / temperature, -1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", SHAPES)
def test_each_shape_has_consistent_special_tokens_and_a_prefix_preserving_template(arch, built, engines):
    path, engine = built[arch], engines[arch]
    config, generation = AutoConfig.from_pretrained(path), GenerationConfig.from_pretrained(path)
    assert config.model_type == arch and config.num_hidden_layers == 2 and config.hidden_size == 64
    tok = engine.tokenizer
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    assert generation.eos_token_id == config.eos_token_id and set(eos) == engine.eos_token_ids
    assert tok.eos_token_id == eos[0] and generation.pad_token_id == config.pad_token_id == tok.pad_token_id
    assert engine.vocab_size == len(tok) == config.vocab_size
    # the tool-call markers are kept in decoded text (the parser needs them); the turn tokens are not
    markers = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert engine.decode([*eos, markers[0], markers[1], tok.pad_token_id]) == "<tool_call></tool_call>"
    messages = [
        {"role": "system", "content": "Use the calculator tool."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    prompt = engine.render(messages, [CALCULATOR_TOOL])
    assert tok.decode(prompt).endswith(HEADERS[arch])
    call = {"function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
    turn = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history = engine.render(turn, [CALCULATOR_TOOL], add_generation_prompt=False)
    longer = engine.render([*turn, {"role": "tool", "content": "5"}], [CALCULATOR_TOOL])
    assert history[: len(prompt)] == prompt and longer[: len(history)] == history
    assert (
        engine.parse_assistant(engine.decode(history[len(prompt) :]))[1][0]["function"]["name"]
        == "calculator"
    )
    closing = closing_tokens(render_fn(engine))
    assert closing and closing[0] in engine.eos_token_ids and history[-len(closing) :] == closing


def test_an_unknown_architecture_or_size_setting_is_a_named_error(tmp_path, corpus):
    with pytest.raises(UnknownArchitecture, match="mamba"):
        build_base_model(tmp_path / "m", corpus=corpus, architecture="mamba")
    with pytest.raises(UnknownArchitecture, match="n_embd"):
        build_base_model(tmp_path / "m", corpus=corpus, architecture="gpt2", shape={"n_embd": 64})


def test_cli_builds_the_architecture_asked_for(tmp_path, capsys):
    assert main(["engine", "build", "--out", str(tmp_path / "g"), "--architecture", "gpt2"]) == 0
    assert '"model_type": "gpt2"' in capsys.readouterr().out
    assert main(["engine", "build", "--out", str(tmp_path / "m"), "--architecture", "mamba"]) == 2
    assert "unknown architecture 'mamba'" in capsys.readouterr().err


@pytest.mark.parametrize("arch", SHAPES)
def test_from_pretrained_reproduces_the_seeded_model(arch, built, engines):
    """The saved weights are the seeded initialisation, all of them (tied weights included), and reloading
    them through `from_pretrained` gives the same logits."""
    path = built[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).eval()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([engines[arch].render([{"role": "user", "content": "Add 67 to bob."}])])
    with torch.no_grad():
        expected = fresh(ids).logits
        assert torch.equal(loaded(ids).logits, expected)
        assert torch.equal(engines[arch].model(ids).logits, expected)


@pytest.mark.parametrize("arch", SHAPES)
def test_batched_left_padded_logprobs_equal_a_teacher_forced_pass(arch, engines):
    engine = engines[arch]
    texts = [
        "Hi",
        "Add 67 to bob, then reply DONE.",
        "What is 2+3? Use the calculator tool, then say the sum.",
    ]
    prompts = [engine.render([{"role": "user", "content": t}]) for t in texts]
    assert len({len(p) for p in prompts}) == 3  # three lengths: two rows are left-padded
    for temperature in (1.0, 0.7):
        gens = engine.generate(prompts, SamplingParams(temperature=temperature, max_tokens=12, seed=3))
        for prompt, gen in zip(prompts, gens, strict=True):
            expected = teacher_forced(engine, prompt, gen.token_ids, temperature)
            assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-5)
    # a second turn extending prompt + response prefills only its new tokens, with the same logprobs
    assert engine.prefix_cache is not None
    hits = engine.prefix_cache.hits
    follow = prompts[1] + gens[1].token_ids + engine.render([{"role": "user", "content": "And?"}])
    gen = engine.generate([follow], SamplingParams(temperature=0.7, max_tokens=8, seed=4))[0]
    assert engine.prefix_cache.hits - hits >= len(prompts[1])
    expected = teacher_forced(engine, follow, gen.token_ids, 0.7)
    assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-5)


@pytest.mark.parametrize("arch", SHAPES)
def test_rows_joining_a_running_batch_keep_exact_logprobs(arch, engines):
    engine = engines[arch]
    prompts = [engine.render([{"role": "user", "content": "x" * (k + 1)}]) for k in range(4)]
    with BatchingEngine(engine, max_batch=8, max_wait_ms=0.0) as batching:
        first = batching.submit(prompts[0], SamplingParams(max_tokens=48, seed=0))
        while not batching.steps_run:
            time.sleep(0.001)
        later = [batching.submit(p, SamplingParams(max_tokens=6, seed=k)) for k, p in enumerate(prompts[1:])]
        results = [f.result(timeout=60) for f in [first, *later]]
        assert batching.batches_run >= 2 and batching.rows_stepped > batching.steps_run  # they ran together
    for prompt, gen in zip(prompts, results, strict=True):
        expected = teacher_forced(engine, prompt, gen.token_ids, 1.0)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-5)


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'store.db'}")
    yield s
    s.close()


@pytest.fixture
def serve(store):
    """A gateway over one of the engines, built on demand."""
    running = []

    def start(engine: Engine) -> Gateway:
        batching = BatchingEngine(engine, max_batch=4, max_wait_ms=1.0)
        server = _serve(store, EngineBackend(batching, resource_id="res")).__enter__()
        running.append((server, batching))
        return Gateway(server, store, server.url)

    yield start
    for server, batching in running:
        server.__exit__(None, None, None)
        batching.close()


@pytest.mark.parametrize("name", [*SHAPES, "llama-rewriting"])
def test_a_tool_conversation_records_token_in_or_a_counted_fallback_and_trains_at_ratio_one(
    name, engines, built, serve
):
    engine = engines[name]
    gw = serve(engine)
    rollout_id, attempt_id, key = gw.attempt()
    client = gw.client(key)
    messages: list[dict] = [
        {"role": "system", "content": "Use the calculator tool."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    tools = [CALCULATOR_TOOL]
    first = client.chat.completions.create(
        model="policy", messages=messages, tools=tools, temperature=1.0, max_tokens=12, seed=1
    ).choices[0]
    assistant = first.message.model_dump(exclude_none=True)
    call_id = assistant["tool_calls"][0]["id"] if assistant.get("tool_calls") else "call_0"
    messages += [assistant, {"role": "tool", "tool_call_id": call_id, "content": "5"}]
    client.chat.completions.create(
        model="policy", messages=messages, tools=tools, temperature=1.0, max_tokens=12, seed=2
    )
    s1, s2 = gw.spans(attempt_id)
    before = s1.prompt_token_ids + s1.response_token_ids
    stats = s2.attributes
    if name == "llama-rewriting":
        # detected (the prompt does not extend the last call's ids), counted, and the fresh render recorded
        assert stats["token_in"] is False and stats["token_in_fallback"] is True
        assert stats["token_source"] == "rendered"
        assert s2.prompt_token_ids == engine.render(messages, tools)
        assert s2.prompt_token_ids[: len(before)] != before
        expected = {"continuations": 1, "token_in": 0, "fallbacks": 1}
    else:
        assert stats["token_in"] is True and stats["token_in_fallback"] is False
        assert stats["token_source"] == "reused" and s2.prompt_token_ids[: len(before)] == before
        expected = {"continuations": 1, "token_in": 1, "fallbacks": 0}
    assert {k: admin_stats(gw, attempt_id)[k] for k in expected} == expected
    # the recorded logprobs are the model's on the recorded ids
    for span in (s1, s2):
        got = teacher_forced(engine, span.prompt_token_ids, span.response_token_ids, 1.0)
        assert torch.allclose(torch.tensor(span.response_logprobs), got, atol=1e-5)

    rows, _ = merge_calls([s1, s2])
    trainer = Trainer(built[name], dataclasses.replace(trainer_config(TrainingSettings()), threads=1))
    mb = collate(rows, list(range(len(rows))))
    with torch.no_grad():
        log_ratio = (response_logprobs(trainer.model, mb) - mb.behaviour)[mb.mask > 0]
    assert int(log_ratio.numel()) == sum(len(s.response_token_ids) for s in (s1, s2))
    assert float(log_ratio.abs().max()) < math.log1p(1e-4)
    metrics = trainer.step(rows, Advantages(values={rollout_id: 1.0}))
    assert metrics["trained_rows"] == len(rows) and metrics["abs_log_ratio_max"] < math.log1p(1e-4)


def admin_stats(gw: Gateway, attempt_id: str) -> dict:
    response = httpx.get(
        f"{gw.url}/admin/attempts/{attempt_id}/stats", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    response.raise_for_status()
    return response.json()["token_in"]
