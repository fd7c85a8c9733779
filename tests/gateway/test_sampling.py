"""The rollout's sampling (`metadata["sampling"]`) decides every call of its attempts, whatever the harness
asks; without one, the harness's request decides. Checked against the engine's own samples."""

from __future__ import annotations

from lightning_dagster.engine import SamplingParams
from lightning_dagster.types import Sampling
from tests.support.stub_upstream import render, reply

QUESTION = [{"role": "user", "content": "What is 17 plus 25?"}]
HARNESS = {"temperature": 1.5, "seed": 7, "max_tokens": 16}  # what the harness asks for on every call


def sample(engine, prompt: list[int], **params) -> list[int]:
    (out,) = engine.generate([prompt], SamplingParams(**params))
    return out.token_ids


def with_sampling(**decided) -> dict:
    return {"sampling": Sampling(**decided).model_dump()}


def test_rollout_temperature_0_samples_greedily_whatever_the_harness_asks(gateway, engine):
    _, aid, key = gateway.attempt(metadata=with_sampling(temperature=0.0))
    client = gateway.client(key)
    client.chat.completions.create(model="policy", messages=QUESTION, **HARNESS)
    chunks = list(client.chat.completions.create(model="policy", messages=QUESTION, stream=True, **HARNESS))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    ids = engine.render(QUESTION)
    client.completions.create(model="policy", prompt=ids, **HARNESS)
    greedy = sample(engine, ids, temperature=0.0, max_tokens=16)
    assert sample(engine, ids, temperature=1.5, seed=7, max_tokens=16) != greedy  # the harness's own ask
    spans = gateway.spans(aid)
    assert [s.attributes["stream"] for s in spans] == [False, True, False]
    assert [s.attributes["token_source"] for s in spans] == ["rendered", "rendered", "ids"]
    for span in spans:
        assert span.prompt_token_ids == ids and span.response_token_ids == greedy
        assert (span.attributes["temperature"], span.attributes["top_p"], span.attributes["max_tokens"]) == (
            0.0,
            1.0,
            16,  # the rollout sets no max_tokens: the harness's applies
        )
        assert span.attributes["requested"] == {"temperature": 1.5, "top_p": None, "max_tokens": 16}


def test_rollout_sampling_applies_to_token_in_continuations(gateway, engine):
    _, aid, key = gateway.attempt(metadata=with_sampling(temperature=0.0))
    client = gateway.client(key)
    first = client.chat.completions.create(model="policy", messages=QUESTION, **HARNESS)
    history = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True)]
    history.append({"role": "user", "content": "And times 2?"})
    client.chat.completions.create(model="policy", messages=history, **HARNESS)
    _, second = gateway.spans(aid)
    assert second.attributes["token_in"] is True and second.attributes["temperature"] == 0.0
    assert second.response_token_ids == sample(
        engine, second.prompt_token_ids, temperature=0.0, max_tokens=16
    )


def test_rollout_top_p_overrides_the_harness(gateway, engine):
    # top_p this small keeps only the most likely token: sampling at temperature 1 is then greedy.
    _, aid, key = gateway.attempt(metadata=with_sampling(temperature=1.0, top_p=1e-6))
    gateway.client(key).chat.completions.create(model="policy", messages=QUESTION, top_p=1.0, **HARNESS)
    (span,) = gateway.spans(aid)
    assert span.response_token_ids == sample(engine, engine.render(QUESTION), temperature=0.0, max_tokens=16)
    assert (span.attributes["temperature"], span.attributes["top_p"]) == (1.0, 1e-6)
    assert span.attributes["requested"] == {"temperature": 1.5, "top_p": 1.0, "max_tokens": 16}


def test_rollout_max_tokens_overrides_the_harness(gateway, engine):
    _, aid, key = gateway.attempt(metadata=with_sampling(temperature=0.0, max_tokens=3))
    client = gateway.client(key)
    client.chat.completions.create(model="policy", messages=QUESTION, **HARNESS)
    client.chat.completions.create(
        model="policy", messages=QUESTION, temperature=1.5, seed=7, max_completion_tokens=16
    )
    greedy = sample(engine, engine.render(QUESTION), temperature=0.0, max_tokens=3)
    assert len(greedy) == 3
    for span in gateway.spans(aid):
        assert span.response_token_ids == greedy and span.finish_reason == "length"
        assert span.attributes["max_tokens"] == 3 and span.attributes["requested"]["max_tokens"] == 16


def test_a_rollout_without_sampling_keeps_the_harness_values(gateway, engine):
    _, aid, key = gateway.attempt()
    gateway.client(key).chat.completions.create(model="policy", messages=QUESTION, top_p=0.9, **HARNESS)
    (span,) = gateway.spans(aid)
    ids = engine.render(QUESTION)
    own = sample(engine, ids, temperature=1.5, top_p=0.9, seed=7, max_tokens=16)
    assert span.response_token_ids == own != sample(engine, ids, temperature=0.0, max_tokens=16)
    assert (span.attributes["temperature"], span.attributes["top_p"], span.attributes["max_tokens"]) == (
        1.5,
        0.9,
        16,
    )
    assert span.attributes["requested"] == {"temperature": 1.5, "top_p": 0.9, "max_tokens": 16}


def test_upstream_mode_forwards_the_rollout_sampling(upstream_gateway):
    gw = upstream_gateway
    _, aid, key = gw.attempt(metadata=with_sampling(temperature=0.0, top_p=0.5, max_tokens=7))
    resp = gw.client(key).chat.completions.create(
        model="policy", messages=QUESTION, temperature=1.5, max_tokens=30
    )
    # The stub replies with as many tokens as the forwarded `max_tokens`: the rollout's 7, not the harness's 30.
    assert resp.choices[0].message.content == reply(render(QUESTION), 7)
    (span,) = gw.spans(aid)
    assert (span.attributes["temperature"], span.attributes["top_p"], span.attributes["max_tokens"]) == (
        0.0,
        0.5,
        7,
    )
    assert span.attributes["requested"] == {"temperature": 1.5, "top_p": None, "max_tokens": 30}
