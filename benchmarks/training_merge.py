"""Trainer tokens per trajectory: merged rows against one row per LLM call, on 3-, 5- and 10-turn traces.

Traces are rendered through the embedded engine's chat template with the calc harness's system prompt and
tool list (what the gateway records with token-in: each prompt extends the previous prompt + response).
Run: .venv/bin/python benchmarks/training_merge.py
"""

from __future__ import annotations

import json
import sys
import tempfile

from lightning_dagster.engine.build import build_base_model
from lightning_dagster.engine.engine import Engine
from lightning_dagster.harnesses.calc.agent import SYSTEM_PROMPT, TOOLS
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.training.transitions import TransitionConfig, merge_calls
from lightning_dagster.types import Span, SpanKind


def trace(engine: Engine, turns: int) -> list[Span]:
    """`turns` calls: turns-1 calculator calls with results, then the answer."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Ann has 12 pens."}]
    spans = []
    for k in range(turns):
        prompt = engine.render(messages, TOOLS)
        if k < turns - 1:
            call = {"id": f"c{k}", "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{k}+12"})}}  # fmt: skip
            reply = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            reply = {"role": "assistant", "content": "ANSWER: 12"}
        full = engine.render([*messages, reply], TOOLS, add_generation_prompt=False)
        end = full.index(engine.tokenizer.convert_tokens_to_ids("<|im_end|>"), len(prompt)) + 1
        response = full[len(prompt) : end]
        spans.append(Span(rollout_id="ro", attempt_id="at", sequence=k, kind=SpanKind.llm, prompt_token_ids=prompt,
                          response_token_ids=response, response_logprobs=[-0.5] * len(response),
                          attributes={"temperature": 1.0}))  # fmt: skip
        messages.append(reply)
        if k < turns - 1:
            messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": str(k + 12)})
    return spans


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        engine = Engine(build_base_model(d, corpus=training_corpus()))
        print(f"{'turns':>5} {'per-call tokens':>16} {'merged tokens':>14} {'ratio':>6} {'rows':>5}")
        ok = True
        for turns, need in ((3, 2.0), (5, None), (10, 5.0)):
            spans = trace(engine, turns)
            merged, stats = merge_calls(spans)
            per_call, _ = merge_calls(spans, TransitionConfig(mode="per_call"))
            a, b = sum(len(r) for r in per_call), sum(len(r) for r in merged)
            print(f"{turns:>5} {a:>16} {b:>14} {a / b:>6.2f} {len(merged):>5}")
            assert len(merged) == 1 and not stats.mismatches
            ok &= need is None or a / b >= need
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
