"""Sampling: returned logprobs are the trainer's teacher-forced log_softmax(logits / T), batches do not change a
seeded request, and stop rules give the right finish_reason."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_dagster.engine import Engine, EngineError, NonFiniteLogits, SamplingParams, StateDictMismatch
from lightning_dagster.engine.sampling import sample


def _prompts(engine) -> list[list[int]]:
    return [
        engine.render(
            [{"role": "user", "content": "Ann has 3 apples and buys 4 more. How many apples now?"}]
        ),
        engine.render([{"role": "user", "content": "Hi"}]),
        engine.render(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 67 to bob."}]
        ),
    ]


def _teacher_forced(engine, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """What the trainer recomputes: one forward over prompt+response, fp32 log_softmax(logits / T)."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_recomputation(engine, temperature):
    prompts = _prompts(engine)
    params = SamplingParams(temperature=temperature, max_tokens=40, seed=11)
    gens = engine.generate(prompts, params)  # a left-padded batch of three prompt lengths
    for prompt, gen in zip(prompts, gens, strict=True):
        assert gen.prompt_token_ids == prompt and len(gen.token_ids) == len(gen.logprobs) > 0
        expected = _teacher_forced(engine, prompt, gen.token_ids, temperature)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)


def test_top_p_logprobs_are_renormalised_over_the_kept_set(engine):
    prompt = _prompts(engine)[0]
    [gen] = engine.generate([prompt], SamplingParams(temperature=1.0, top_p=0.5, max_tokens=20, seed=3))
    full = _teacher_forced(engine, prompt, gen.token_ids, 1.0)
    # renormalising over a subset raises every sampled token's logprob (or keeps it, if the set is one token)
    assert all(lp >= f - 1e-5 for lp, f in zip(gen.logprobs, full.tolist(), strict=True))
    assert any(lp > f + 1e-3 for lp, f in zip(gen.logprobs, full.tolist(), strict=True))


def test_the_top_p_set_does_not_move_when_the_logits_move_by_their_last_bit():
    """The same row's logits differ in their last bits between batch shapes. A token whose mass before it lies
    just under top_p must stay in the set under that noise, or its mass would shift the renormalised logprobs
    (a request's behaviour logprobs would depend on its batch mates)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(768, generator=g)  # a flat distribution: the top-p set ends in a long tail
    temperature = 0.7
    probs = torch.softmax(logits.double() / temperature, dim=-1).sort(descending=True).values
    mass_before = probs.cumsum(-1) - probs
    k = int((mass_before < 0.9).sum()) - 1  # the last token a top_p of 0.9 keeps
    top_p = float(mass_before[k]) + 1e-7  # kept by a margin below float32's rounding of the mass
    ulp = torch.nextafter(logits.abs(), torch.tensor(float("inf"))) - logits.abs()
    rows = logits + ulp * torch.randint(-1, 2, (256, 768), generator=g)
    n = rows.shape[0]
    tokens, logprobs = sample(
        rows,
        torch.full((n,), temperature),
        torch.full((n,), top_p, dtype=torch.float64),
        [torch.Generator().manual_seed(5) for _ in range(n)],
    )
    assert (tokens == tokens[0]).all()
    assert float(logprobs.max() - logprobs.min()) < 1e-5


def test_temperature_zero_is_greedy_with_logprobs_under_t1(engine):
    prompt = _prompts(engine)[1]
    [gen] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=15))
    ids = list(prompt)
    with torch.no_grad():
        for token in gen.token_ids:
            assert token == int(engine.model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
    expected = _teacher_forced(engine, prompt, gen.token_ids, 1.0)
    assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_padded_batch(engine):
    short, long_ = _prompts(engine)[1], _prompts(engine)[0]
    assert len(short) < len(long_)  # the request of interest gets left-padded in the batch
    mine = SamplingParams(temperature=1.0, max_tokens=30, seed=1234)
    [alone] = engine.generate([short], mine)
    mates = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7), SamplingParams(max_tokens=50, seed=9)]
    batch = engine.generate([long_, short, long_], [mates[0], mine, mates[1]])
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].text == alone.text
    assert max(abs(a - b) for a, b in zip(batch[1].logprobs, alone.logprobs, strict=True)) < 1e-5
    assert len(batch[0].token_ids) <= 7 and batch[2].token_ids != alone.token_ids
    # and an unseeded request differs between calls (its generator is drawn fresh)
    free = [engine.generate([short], SamplingParams(max_tokens=30))[0].token_ids for _ in range(2)]
    assert free[0] != free[1]


def test_max_tokens_gives_finish_reason_length(engine):
    [gen] = engine.generate([_prompts(engine)[0]], SamplingParams(max_tokens=9, seed=2))
    assert gen.finish_reason == "length" and len(gen.token_ids) == 9


@pytest.mark.parametrize("length", [2, 7])
def test_stop_string_cuts_text_and_gives_finish_reason_stop(engine, length):
    prompt = _prompts(engine)[0]
    params = SamplingParams(max_tokens=40, seed=5)
    [free] = engine.generate([prompt], params)
    # choose a stop string the seeded sample is known to contain, past its first token
    stop = next(
        free.text[j : j + length]
        for j in range(len(free.text) // 2, len(free.text) - length)
        if free.text[j : j + length].strip() and "\ufffd" not in free.text[j : j + length]
    )
    first = free.text.find(stop)
    params.stop = ["never-sampled-zzz", stop]
    [gen] = engine.generate([prompt], params)
    assert gen.finish_reason == "stop"
    assert gen.text == free.text[:first]
    assert gen.token_ids == free.token_ids[: len(gen.token_ids)] and len(gen.token_ids) < len(free.token_ids)
    assert stop in engine.decode(gen.token_ids) and stop not in engine.decode(gen.token_ids[:-1])


def test_eos_token_stops_the_row_and_is_kept_with_its_logprob(engine):
    prompt = _prompts(engine)[2]
    [free] = engine.generate([prompt], SamplingParams(max_tokens=20, seed=8))
    # make the fourth sampled token the end-of-turn token for this check (the random model never ends)
    saved = set(engine.eos_token_ids)
    engine.eos_token_ids = {free.token_ids[3]} | saved
    try:
        [gen] = engine.generate([prompt], SamplingParams(max_tokens=20, seed=8))
    finally:
        engine.eos_token_ids = saved
    assert gen.finish_reason == "stop"
    assert gen.token_ids[-1] == free.token_ids[3] and len(gen.token_ids) <= 4
    assert len(gen.logprobs) == len(gen.token_ids)
    assert gen.text == engine.decode(gen.token_ids[:-1])


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.1),
        dict(temperature=float("inf")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(stop="x"),
        dict(stop=[""]),
        dict(seed="7"),
    ],
)
def test_invalid_sampling_params_raise_engine_error(engine, bad):
    with pytest.raises(EngineError):
        engine.generate([_prompts(engine)[1]], SamplingParams(**bad))


def test_invalid_prompts_raise_engine_error(engine):
    for prompt in ([], [engine.vocab_size], [-1], [0] * engine.max_length):
        with pytest.raises(EngineError):
            engine.generate([prompt], SamplingParams())
    with pytest.raises(EngineError):
        engine.generate([[1], [2]], [SamplingParams()])


def test_load_weights_changes_the_live_model_and_is_strict(engine):
    prompt = _prompts(engine)[0]
    params = SamplingParams(max_tokens=12, seed=4)
    before = engine.generate([prompt], params)[0]
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        changed = {k: v * 1.5 if k.endswith("norm.weight") else v for k, v in original.items()}
        engine.load_weights(changed)
        after = engine.generate([prompt], params)[0]
        assert after.logprobs != before.logprobs
        expected = _teacher_forced(engine, prompt, after.token_ids, 1.0)
        assert torch.allclose(torch.tensor(after.logprobs), expected, atol=1e-4)
        with pytest.raises(StateDictMismatch):
            engine.load_weights({k: v for k, v in original.items() if "layers.0." not in k})
        with pytest.raises(StateDictMismatch):
            engine.load_weights({**original, "model.norm.weight": torch.ones(3)})
        # nothing was copied by the refused loads
        assert engine.generate([prompt], params)[0].logprobs == after.logprobs
    finally:
        engine.load_weights(original)
    assert engine.generate([prompt], params)[0].token_ids == before.token_ids


def test_nan_weights_raise_a_named_error_not_garbage(engine):
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        engine.load_weights(
            {**original, "model.norm.weight": torch.full_like(original["model.norm.weight"], float("nan"))}
        )
        with pytest.raises(NonFiniteLogits):
            engine.generate([_prompts(engine)[1]], SamplingParams(max_tokens=3))
    finally:
        engine.load_weights(original)


def test_load_weights_waits_for_the_running_generate(engine):
    """A weight push during a generate call lands after it: every token of that call comes from the old
    weights, and the next call sees the new ones."""
    prompt = _prompts(engine)[0]
    params = SamplingParams(max_tokens=48, seed=6)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    changed = {k: v * 1.5 if k.endswith("norm.weight") else v for k, v in original.items()}
    result: list = []
    worker = threading.Thread(target=lambda: result.append(engine.generate([prompt] * 8, params)))
    try:
        worker.start()
        while not engine._lock.locked() and worker.is_alive():
            time.sleep(0.001)
        engine.load_weights(changed)  # blocks until the generate call releases the lock
        worker.join()
        gen = result[0][0]
        new = _teacher_forced(engine, prompt, gen.token_ids, 1.0)
        engine.load_weights(original)
        old = _teacher_forced(engine, prompt, gen.token_ids, 1.0)
        assert torch.allclose(torch.tensor(gen.logprobs), old, atol=1e-4)
        assert not torch.allclose(torch.tensor(gen.logprobs), new, atol=1e-2)
    finally:
        worker.join()
        engine.load_weights(original)


def test_a_next_turn_reuses_the_cached_prefix_with_exact_logprobs(engine, model_dir):
    """Turn 2 prompts extend turn 1's prompt+response: the engine prefills only the new tokens, and the
    result is what an engine without the cache samples, with teacher-forced logprobs."""
    cold = Engine(model_dir, prefix_cache_mb=0)
    prompts = _prompts(engine)
    params = [SamplingParams(max_tokens=8 + 5 * i, seed=20 + i) for i in range(3)]
    first = engine.generate(prompts, params)
    second = [
        p + g.token_ids + engine.encode(f" tool said {i}")
        for i, (p, g) in enumerate(zip(prompts, first, strict=True))
    ]
    hits = engine.prefix_cache.hits
    warm = engine.generate(second, params)
    assert engine.prefix_cache.hits - hits == sum(
        len(p) + len(g.token_ids) - 1 for p, g in zip(prompts, first, strict=True)
    )
    reference = cold.generate(second, params)
    for p, w, r in zip(second, warm, reference, strict=True):
        assert w.token_ids == r.token_ids
        expected = _teacher_forced(engine, p, w.token_ids, 1.0)
        assert torch.allclose(torch.tensor(w.logprobs), expected, atol=1e-4)


def test_new_weights_invalidate_the_prefix_cache(engine):
    prompt = _prompts(engine)[1]
    params = SamplingParams(max_tokens=10, seed=31)
    [first] = engine.generate([prompt], params)
    assert len(engine.prefix_cache) > 0
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    try:
        engine.load_weights({k: v * 1.5 if k.endswith("norm.weight") else v for k, v in original.items()})
        assert len(engine.prefix_cache) == 0
        longer = prompt + first.token_ids + engine.encode(" more")
        [gen] = engine.generate([longer], params)
        expected = _teacher_forced(engine, longer, gen.token_ids, 1.0)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)
    finally:
        engine.load_weights(original)


def test_identical_prompts_are_prefilled_once_and_sampled_independently(engine):
    """A GRPO group (the same prompt many times) shares one prefill row; each row still samples on its own."""
    prompt, other = _prompts(engine)[0], _prompts(engine)[1]
    batch = [prompt, other, prompt, prompt]
    params = [SamplingParams(max_tokens=12, seed=s) for s in (1, 2, 3, 4)]
    shapes: list[tuple[int, ...]] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        gens = engine.generate(batch, params)
    finally:
        hook.remove()
    assert shapes[0][0] == 2 and shapes[1][0] == 4  # prefill over 2 unique prompts, then 4 rows decode
    for p, s, g in zip(batch, params, gens, strict=True):
        [alone] = engine.generate([p], s)
        assert g.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, alone.logprobs, strict=True)) < 1e-5
    assert len({tuple(g.token_ids) for g in gens}) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_engine_samples_on_cuda_with_finite_logprobs_like_on_cpu(model_dir):
    cpu, cuda = Engine(model_dir, device="cpu"), Engine(model_dir, device="cuda")
    assert cuda.device.type == "cuda" and next(cuda.model.parameters()).device.type == "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=16, seed=3)
    on_cpu, on_cuda = cpu.generate(_prompts(cpu), params), cuda.generate(_prompts(cuda), params)
    # bf16 autocast may pick other near-tied tokens than float32: same shapes, finite logprobs
    for a, b in zip(on_cpu, on_cuda, strict=True):
        assert len(b.token_ids) == len(b.logprobs) > 0 and all(torch.isfinite(torch.tensor(b.logprobs)))
        assert b.prompt_token_ids == a.prompt_token_ids
