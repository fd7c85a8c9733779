"""Token-out and token-in through the real openai client, a real GatewayServer, the real engine and Store."""

from __future__ import annotations

import json

import httpx

from lightning_dagster.engine import SamplingParams
from lightning_dagster.gateway.tokenin import LastCall, closing_tokens, continue_prompt
from tests.gateway.conftest import ADMIN

QUESTION = [{"role": "user", "content": "What is 17 plus 25?"}]


def test_recorded_ids_and_logprobs_equal_what_the_engine_sampled(gateway, engine):
    rid, aid, key = gateway.attempt()
    resp = gateway.client(key).chat.completions.create(
        model="policy", messages=QUESTION, temperature=1.0, seed=1234, max_tokens=24, logprobs=True
    )
    (span,) = gateway.spans(aid)
    prompt = engine.render(QUESTION)
    (direct,) = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=24, seed=1234))
    assert span.prompt_token_ids == prompt == resp.model_extra["prompt_token_ids"]
    assert span.response_token_ids == direct.token_ids == resp.choices[0].model_extra["token_ids"]
    assert span.response_logprobs == direct.logprobs
    assert [t.logprob for t in resp.choices[0].logprobs.content] == direct.logprobs
    assert span.finish_reason == resp.choices[0].finish_reason == direct.finish_reason
    assert resp.choices[0].message.content == direct.text
    assert (span.rollout_id, span.resource_id, span.kind.value) == (rid, "res-base", "llm")
    assert span.attributes["token_in"] is False and span.attributes["temperature"] == 1.0
    assert span.attributes["seed"] == 1234 and span.attributes["latency_s"] > 0


def test_token_in_reuses_exact_ids_when_the_response_does_not_survive_retokenization(
    scripted_gateway, scripted
):
    eng, _, script = scripted
    _, aid, key = scripted_gateway.attempt()
    client = scripted_gateway.client(key)
    first = client.chat.completions.create(model="policy", messages=QUESTION, temperature=0)
    msg = first.choices[0].message
    (s1,) = scripted_gateway.spans(aid)
    # The model sampled b,a,l: text "bal" re-encodes as one merged token, so re-rendering would drift.
    assert s1.response_token_ids[: len(script.drift)] == script.drift
    assert eng.encode(eng.decode(s1.response_token_ids)) != s1.response_token_ids[:-1]
    # The harness echoes the assistant message exactly as the openai client returned it, plus a tool result.
    history = [*QUESTION, msg.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "12:00"})
    client.chat.completions.create(model="policy", messages=history, temperature=0)
    s1, s2 = scripted_gateway.spans(aid)
    context = s1.prompt_token_ids + s1.response_token_ids
    assert s2.prompt_token_ids[: len(context)] == context
    assert s2.attributes["token_in"] is True and s2.attributes["token_source"] == "reused"
    # ... followed by the template's end of turn (EOS was sampled), the tool turn and the generation prompt.
    closing = closing_tokens(lambda m, t, g: eng.render(m, t, add_generation_prompt=g))
    delta = eng.render(history)[len(eng.render(history[:2], add_generation_prompt=False)) :]
    assert s2.prompt_token_ids == context + closing[1:] + delta
    assert eng.render(history)[: len(context)] != context  # a fresh render would not extend the sampled ids
    stats = httpx.get(
        f"{scripted_gateway.url}/admin/attempts/{aid}/stats", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert stats.json()["token_in"] == {
        "calls": 2,
        "continuations": 1,
        "token_in": 1,
        "fallbacks": 0,
        "token_in_share": 1.0,
    }


def test_tool_calls_round_trip_through_the_openai_client(scripted_gateway):
    _, aid, key = scripted_gateway.attempt()
    client = scripted_gateway.client(key)
    tools = [{"type": "function", "function": {"name": "now", "description": "the time", "parameters": {}}}]
    resp = client.chat.completions.create(model="policy", messages=QUESTION, tools=tools, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (
        call.type == "function" and call.function.name == "now" and json.loads(call.function.arguments) == {}
    )
    assert call.id.startswith("call_")
    messages = [*QUESTION, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    again = client.chat.completions.create(model="policy", messages=messages, tools=tools, temperature=0)
    assert again.choices[0].message.tool_calls[0].function.name == "now"
    spans = scripted_gateway.spans(aid)
    assert [s.finish_reason for s in spans] == ["tool_calls", "tool_calls"]
    assert [s.attributes["token_in"] for s in spans] == [False, True]
    assert [s.attributes["tool_calls"] for s in spans] == [1, 1]


def test_streaming_and_non_streaming_record_the_same_span(gateway):
    spans = []
    texts = []
    for stream in (False, True):
        _, aid, key = gateway.attempt()
        client = gateway.client(key)
        kwargs = dict(model="policy", messages=QUESTION, temperature=1.0, seed=77, max_tokens=20)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        else:
            texts.append(client.chat.completions.create(**kwargs).choices[0].message.content)
        (span,) = gateway.spans(aid)
        spans.append(span)
    plain, streamed = spans
    assert streamed.prompt_token_ids == plain.prompt_token_ids
    assert streamed.response_token_ids == plain.response_token_ids
    assert streamed.response_logprobs == plain.response_logprobs
    assert streamed.finish_reason == plain.finish_reason
    assert texts[0] == texts[1]
    assert (plain.attributes["stream"], streamed.attributes["stream"]) == (False, True)


def test_completions_take_token_ids_verbatim(gateway, engine):
    _, aid, key = gateway.attempt()
    ids = engine.render(QUESTION)
    resp = gateway.client(key).completions.create(
        model="policy", prompt=ids, max_tokens=8, seed=5, logprobs=1
    )
    (span,) = gateway.spans(aid)
    assert span.prompt_token_ids == ids == resp.choices[0].model_extra["prompt_token_ids"]
    assert span.response_token_ids == resp.choices[0].model_extra["token_ids"]
    assert resp.choices[0].logprobs.token_logprobs == span.response_logprobs
    assert span.attributes["token_source"] == "ids"


def test_rollout_sampling_seed_gives_common_random_numbers(gateway):
    ids, seeds = [], []
    for _ in range(2):
        _, aid, key = gateway.attempt(metadata={"sampling_seed": 42})
        client = gateway.client(key)
        for _ in range(2):
            client.chat.completions.create(model="policy", messages=QUESTION, temperature=1.0, max_tokens=12)
        ids.append([s.response_token_ids for s in gateway.spans(aid)])
        seeds.append([s.attributes["seed"] for s in gateway.spans(aid)])
    assert ids[0] == ids[1] and seeds[0] == seeds[1]
    assert seeds[0][0] != seeds[0][1]  # call 1 and call 2 get different seeds ...
    assert ids[0][0] != ids[0][1]  # ... so they sample different responses to the same prompt


def test_continue_prompt_invariant_on_the_real_template(engine):
    render = lambda m, t, g: engine.render(m, t, add_generation_prompt=g)  # noqa: E731
    closing = closing_tokens(render)
    assert closing[0] in engine.eos_token_ids
    prompt = engine.render(QUESTION)
    for response, ended in (([300, 301, 2], True), ([300, 301], False)):
        assistant = {"role": "assistant", "content": engine.decode(response)}
        last = LastCall.of(QUESTION, assistant, None, prompt, response)
        history = [*QUESTION, assistant, {"role": "user", "content": "and times 2?"}]
        ids = continue_prompt(render, closing, last, history, None)
        glue = closing[1:] if ended else closing
        delta = engine.render(history)[
            len(engine.render([*QUESTION, assistant], add_generation_prompt=False)) :
        ]
        assert ids == prompt + response + glue + delta
    # an edited history is not a continuation
    edited = [{"role": "user", "content": "What is 17 plus 26?"}, assistant, {"role": "user", "content": "?"}]
    assert continue_prompt(render, closing, last, edited, None) is None
