"""On the first update the trainer's probability of every trained token equals the engine's (ratio 1 within
1e-4) for multi-turn merged rows sampled at T=1.0, T=0.7 and greedily, scored together in one micro-batch
at each row's own recorded temperature: the trainer's logprobs are the sampler's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lightning_dagster.engine.engine import Engine, SamplingParams
from lightning_dagster.training.trainer import collate, load_model, response_logprobs
from lightning_dagster.training.transitions import merge_calls
from lightning_dagster.types import Span, SpanKind


@pytest.fixture(scope="module")
def engine(base_model_dir) -> Engine:
    return Engine(base_model_dir)


def sampled_trace(engine: Engine, temperature: float, seed: int) -> list[Span]:
    """Two sampled turns with a tool result between them, recorded as the gateway would (token-in)."""
    messages = [
        {"role": "system", "content": "Use the calculator tool."},
        {"role": "user", "content": f"Ann has {seed + 12} pens and gets 7 more. How many now?"},
    ]
    prompt = engine.render(messages)
    spans = []
    for turn in range(2):
        params = SamplingParams(temperature=temperature, max_tokens=24, seed=seed * 10 + turn)
        gen = engine.generate([prompt], params)[0]
        spans.append(
            Span(
                rollout_id=f"ro-{seed}",
                attempt_id=f"at-{seed}",
                sequence=turn,
                kind=SpanKind.llm,
                prompt_token_ids=gen.prompt_token_ids,
                response_token_ids=gen.token_ids,
                response_logprobs=gen.logprobs,
                finish_reason="stop",  # bridge even a cut-off turn: the test is about the ratio
                attributes={"temperature": temperature},  # as the gateway records it
            )
        )
        tool = engine.encode("<|im_end|>\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n")
        prompt = prompt + gen.token_ids + tool
    return spans


TEMPERATURES = [1.0, 0.7, 0.0]


def test_first_update_ratio_is_one_on_every_trained_token_at_each_rows_temperature(engine, base_model_dir):
    rows = []
    for seed, temperature in enumerate(TEMPERATURES * 2):
        r, stats = merge_calls(sampled_trace(engine, temperature, seed))
        assert len(r) == 1 and stats.bridges == 1 and r[0].temperature == temperature
        rows += r
    model = load_model(base_model_dir)
    mb = collate(rows, list(range(len(rows))))  # rows of different lengths: padding and attention mask
    assert mb.temperatures.tolist() == pytest.approx([1.0, 0.7, 1.0] * 2)  # greedy rows: scored at T=1
    with torch.no_grad():
        logp = response_logprobs(model, mb)
    on = mb.mask > 0
    assert int(on.sum()) >= len(rows) * 2
    log_ratio = (logp - mb.behaviour)[on]
    assert float(log_ratio.abs().max()) < math.log1p(1e-4), float(log_ratio.abs().max())
    # and the check can fail: one temperature for every row is far off on the rows sampled at another
    for wrong in (1.0, 0.7):
        uniform = dataclasses.replace(mb, temperatures=torch.full_like(mb.temperatures, wrong))
        with torch.no_grad():
            off = response_logprobs(model, uniform)
        assert float((off - mb.behaviour)[on].abs().max()) > 1e-2
