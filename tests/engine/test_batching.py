"""BatchingEngine: concurrent submitters share one running batch (continuous batching: requests join between
decode steps and leave as soon as they finish) and each gets its own exact result."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_dagster.engine import (
    BatchingEngine,
    Engine,
    EngineClosed,
    EngineError,
    NonFiniteLogits,
    SamplingParams,
)
from lightning_dagster.engine.batch import RunningBatch


def _request(engine, i: int) -> tuple[list[int], SamplingParams]:
    prompt = engine.render(
        [{"role": "user", "content": f"Ann has {i} apples and buys {i + 3} more." * (1 + i % 3)}]
    )
    return prompt, SamplingParams(
        temperature=[1.0, 0.7, 0.0][i % 3], top_p=[1.0, 0.9][i % 2], max_tokens=6 + i, seed=i
    )


def _same(got, expected) -> None:
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert got.finish_reason == expected.finish_reason and got.prompt_token_ids == expected.prompt_token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, expected.logprobs, strict=True)) < 1e-5


def _teacher_forced(engine, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1), torch.tensor(response)]


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@pytest.mark.parametrize("continuous", [True, False])
def test_sixteen_threads_get_their_unbatched_seeded_results(engine, continuous):
    requests = [_request(engine, i) for i in range(16)]
    expected = [engine.generate([p], s)[0] for p, s in requests]
    barrier = threading.Barrier(16)

    def call(i: int):
        barrier.wait()  # all submit at once, so they must share batches
        return batching.submit(*requests[i]).result(timeout=60)

    with BatchingEngine(engine, max_batch=64, max_wait_ms=50, continuous=continuous) as batching:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(call, range(16)))
    assert batching.batches_run < 16  # admissions: requests were prefilled together
    assert batching.rows_stepped / batching.steps_run > 1
    for g, e in zip(got, expected, strict=True):
        _same(g, e)


def test_many_two_turn_callers_match_a_cold_engine_alone(engine, model_dir):
    """24 conversations of two turns each, all at once: turn 2 extends turn 1 and joins a running batch with
    its prefix from the cache. Every result equals the request sampled alone by an engine without a cache."""
    cold = Engine(model_dir, prefix_cache_mb=0)
    n = 24

    def turn2(i: int, prompt: list[int], first) -> list[int]:
        return prompt + first.token_ids + engine.encode(f" the tool said {i * 7}")

    def call(i: int):
        prompt, params = _request(engine, i % 12)
        params.seed = 100 + i
        first = batching.submit(prompt, params).result(timeout=120)
        second = batching.submit(turn2(i, prompt, first), params).result(timeout=120)
        return prompt, params, first, second

    hits = engine.prefix_cache.hits
    with BatchingEngine(engine, max_batch=16, max_wait_ms=5) as batching:
        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(call, range(n)))
    assert engine.prefix_cache.hits > hits  # turn 2 reused turn 1's keys and values
    assert batching.batches_run < 2 * n and batching.rows_stepped / batching.steps_run > 2
    for i, (prompt, params, first, second) in enumerate(got):
        _same(first, cold.generate([prompt], params)[0])
        _same(second, cold.generate([turn2(i, prompt, first)], params)[0])


@pytest.mark.parametrize("joiner_is_longer", [False, True])
@pytest.mark.parametrize("after_steps", [1, 9])
def test_a_seeded_request_is_the_same_alone_and_joining_mid_flight(engine, joiner_is_longer, after_steps):
    """Tokens and logprobs of a seeded request do not depend on when it joins: the merge left-pads the
    running rows (a longer joiner) or the joiner (a shorter one) and positions follow the mask."""
    mates = [_request(engine, i) for i in (2, 4, 7)]
    mates = [(p, SamplingParams(temperature=0.8, max_tokens=30, seed=s.seed)) for p, s in mates]
    width = max(len(p) for p, _ in mates) + after_steps
    text = "How many apples? " * (12 if joiner_is_longer else 1)
    mine = engine.render([{"role": "user", "content": text}])
    assert (len(mine) > width) == joiner_is_longer
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=77)
    [alone] = engine.generate([mine], params)

    with engine.exclusive():
        batch = RunningBatch(engine)
        assert batch.admit([p for p, _ in mates], [s for _, s in mates], ["a", "b", "c"]) == []
        for _ in range(after_steps):
            assert batch.step() == []
        assert batch.admit([mine], [params], ["mine"]) == []
        results = {}
        while batch:
            results.update(batch.step())
    _same(results["mine"], alone)
    for tag, (p, s) in zip("abc", mates, strict=True):
        _same(results[tag], engine.generate([p], s)[0])


def test_a_joiner_reuses_a_finished_rows_slot_in_place_and_stays_exact(engine):
    """A row that finishes leaves a dead slot; the next narrower joiner is written into it (no copy of the
    cache), a wider one is appended after compaction; every result equals its request sampled alone."""
    reqs = {
        "short": (_request(engine, 1)[0], SamplingParams(max_tokens=3, seed=1)),
        "a": (_request(engine, 5)[0], SamplingParams(temperature=0.7, max_tokens=25, seed=2)),
        "b": (_request(engine, 8)[0], SamplingParams(top_p=0.9, max_tokens=25, seed=3)),
        "c": (_request(engine, 9)[0], SamplingParams(max_tokens=40, seed=4)),
        "narrow": (engine.render([{"role": "user", "content": "Hi"}]), SamplingParams(max_tokens=12, seed=5)),
        "wide": (_request(engine, 11)[0] * 2, SamplingParams(max_tokens=8, seed=6)),
    }
    expected = {tag: engine.generate([p], s)[0] for tag, (p, s) in reqs.items()}
    results = {}

    def admit(*tags: str) -> None:
        assert batch.admit([reqs[t][0] for t in tags], [reqs[t][1] for t in tags], list(tags)) == []

    with engine.exclusive():
        batch = RunningBatch(engine)
        admit("short", "a", "b", "c")
        for _ in range(3):
            results.update(batch.step())
        assert list(results) == ["short"] and batch.slots[0] is None and len(batch) == 3
        admit("narrow")
        assert batch.slots[0].tag == "narrow" and len(batch.slots) == 4  # written into the dead slot
        for _ in range(2):
            results.update(batch.step())
        width = batch._mask.shape[1]
        assert len(reqs["wide"][0]) > width
        admit("wide")
        assert batch.slots[-1].tag == "wide" and batch._mask.shape[1] == len(reqs["wide"][0])
        while batch:
            results.update(batch.step())
            assert len(batch.slots) <= 5
    for tag, gen in expected.items():
        _same(results[tag], gen)


def test_a_late_request_joins_the_running_batch_and_finishes_first(engine):
    """No head-of-line blocking: a short request submitted while a long one runs joins it and returns long
    before the long one ends, with the same result it gets alone."""
    long_prompt, _ = _request(engine, 0)
    long_params = SamplingParams(max_tokens=160, seed=1)
    late_prompt, late_params = _request(engine, 5)
    expected = engine.generate([late_prompt], late_params)[0]
    finished: list[str] = []
    with BatchingEngine(engine, max_wait_ms=0) as batching:
        early = batching.submit(long_prompt, long_params)
        early.add_done_callback(lambda _f: finished.append("early"))
        _wait_for(lambda: batching.steps_run >= 10)
        late = batching.submit(late_prompt, late_params)
        late.add_done_callback(lambda _f: finished.append("late"))
        _same(late.result(timeout=60), expected)
        assert not early.done()
        assert len(early.result(timeout=120).token_ids) == 160
    assert finished == ["late", "early"]
    assert batching.batches_run == 2 and batching.rows_stepped > batching.steps_run


def test_a_model_whose_cache_cannot_merge_rows_falls_back_to_fresh_batches(engine, monkeypatch):
    """Without plain per-row cache layers (e.g. sliding windows) rows only join an empty batch: the late
    request then waits for the running one, and both are still exact."""
    monkeypatch.setattr(engine, "mergeable", False)
    (p1, s1), (p2, s2) = _request(engine, 0), _request(engine, 5)
    s1 = SamplingParams(max_tokens=40, seed=1)
    expected = [engine.generate([p1], s1)[0], engine.generate([p2], s2)[0]]
    with BatchingEngine(engine, max_wait_ms=0) as batching:
        early = batching.submit(p1, s1)
        _wait_for(lambda: batching.steps_run >= 3)
        late = batching.submit(p2, s2)
        _same(late.result(timeout=60), expected[1])
        assert early.done()
        _same(early.result(), expected[0])
    assert batching.batches_run == 2 and batching.rows_stepped == batching.steps_run


def test_a_weight_push_drains_the_running_rows_first(engine):
    """load_weights during a running batch stops admissions, lets the running rows finish on the old
    weights (their logprobs match the old model exactly), then lands; a request queued while the push
    waited runs after it, on the new weights."""
    prompt, _ = _request(engine, 1)
    other, _ = _request(engine, 4)
    params = SamplingParams(max_tokens=30, seed=3)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    changed = {k: v * 1.5 if k.endswith("norm.weight") else v for k, v in original.items()}
    try:
        with BatchingEngine(engine, max_wait_ms=0) as batching:
            running = batching.submit(prompt, SamplingParams(max_tokens=200, seed=3))
            _wait_for(lambda: batching.steps_run >= 5)
            push = threading.Thread(target=engine.load_weights, args=(changed,))
            push.start()
            _wait_for(lambda: engine.waiting == 1)
            queued = batching.submit(other, params)  # must not join the draining batch
            push.join(timeout=60)
            assert running.done() and not push.is_alive()
            after = batching.submit(prompt, params).result(timeout=60)
            during = queued.result(timeout=60)
        before = running.result()
        assert len(before.token_ids) == 200
        for p, gen in ((prompt, after), (other, during)):
            new = _teacher_forced(engine, p, gen.token_ids)
            assert torch.allclose(torch.tensor(gen.logprobs), new, atol=1e-4)
        engine.load_weights(original)
        old = _teacher_forced(engine, prompt, before.token_ids)
        assert torch.allclose(torch.tensor(before.logprobs), old, atol=1e-4)
    finally:
        engine.load_weights(original)


def test_errors_reach_the_future_and_batch_mates_are_unaffected(engine):
    prompt, params = _request(engine, 1)
    with BatchingEngine(engine, max_wait_ms=20) as batching:
        bad = batching.submit(prompt, SamplingParams(top_p=2.0))
        worse = batching.submit([engine.vocab_size + 5], params)
        good = batching.submit(prompt, params)
        with pytest.raises(EngineError):
            bad.result(timeout=10)
        with pytest.raises(EngineError):
            worse.result(timeout=10)
        assert good.result(timeout=60).token_ids == engine.generate([prompt], params)[0].token_ids
    with pytest.raises(EngineClosed):
        batching.submit(prompt, params).result(timeout=1)


@pytest.mark.parametrize("continuous", [True, False])
def test_a_failure_inside_a_prefill_fails_only_its_request(engine, monkeypatch, continuous):
    """If prefilling a group raises, each request is admitted alone, so only the culprit fails; rows already
    running are untouched."""
    real = engine._prefill_inputs
    poison = [5, 5, 5]

    def flaky(prompts, hits, cache):
        if poison in prompts:
            raise EngineError("poisoned prompt")
        return real(prompts, hits, cache)

    monkeypatch.setattr(engine, "_prefill_inputs", flaky)
    prompt, params = _request(engine, 2)
    long_prompt, _ = _request(engine, 4)
    long_params = SamplingParams(max_tokens=40, seed=2)
    expected = [engine.generate([p], s)[0] for p, s in ((prompt, params), (long_prompt, long_params))]
    with BatchingEngine(engine, max_wait_ms=100, continuous=continuous) as batching:
        futures = [batching.submit(poison, params), batching.submit(prompt, params)]
        with pytest.raises(EngineError, match="poisoned"):
            futures[0].result(timeout=30)
        _same(futures[1].result(timeout=30), expected[0])
        running = batching.submit(long_prompt, long_params)
        _wait_for(lambda: running.running())
        late = [batching.submit(poison, params), batching.submit(prompt, params)]
        with pytest.raises(EngineError, match="poisoned"):
            late[0].result(timeout=30)
        _same(late[1].result(timeout=30), expected[0])
        _same(running.result(timeout=60), expected[1])


def test_non_finite_logits_fail_exactly_the_affected_callers(engine, monkeypatch):
    """A row whose logits turn NaN fails with NonFiniteLogits alone; broken weights fail every caller."""
    real = engine._forward
    marker = 7  # a prompt containing this token gets NaN logits at prefill

    def nan_rows(ids, mask, positions, cache):
        logits = real(ids, mask, positions, cache)
        if ids.shape[1] > 1:
            logits[(ids == marker).any(-1)] = float("nan")
        return logits

    prompt, params = _request(engine, 3)
    assert marker not in prompt
    expected = engine.generate([prompt], params)[0]
    monkeypatch.setattr(engine, "_forward", nan_rows)
    with BatchingEngine(engine, max_wait_ms=50) as batching:
        futures = [batching.submit(prompt + [marker, 9], params), batching.submit(prompt, params)]
        with pytest.raises(NonFiniteLogits):
            futures[0].result(timeout=30)
        _same(futures[1].result(timeout=30), expected)
    monkeypatch.undo()

    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    nan = torch.full_like(original["model.norm.weight"], float("nan"))
    try:
        engine.load_weights({**original, "model.norm.weight": nan})
        with BatchingEngine(engine, max_wait_ms=20) as batching:
            futures = [batching.submit(*_request(engine, i)) for i in range(4)]
            for f in futures:
                with pytest.raises(NonFiniteLogits):
                    f.result(timeout=30)
    finally:
        engine.load_weights(original)


def test_close_fails_queued_requests_and_stops_the_thread(engine):
    batching = BatchingEngine(engine, max_batch=1, max_wait_ms=0)
    prompt, params = _request(engine, 3)
    futures = [batching.submit(prompt, params) for _ in range(20)]
    batching.close()
    outcomes = [f.exception(timeout=30) for f in futures]
    served = [o is None for o in outcomes]
    assert served == sorted(served, reverse=True)  # those served came first, in order
    assert all(o is None or isinstance(o, EngineClosed) for o in outcomes)
    assert isinstance(outcomes[-1], EngineClosed)
    assert not batching._thread.is_alive()


def test_close_finishes_the_running_rows_and_fails_the_queued_ones(engine):
    prompt, _ = _request(engine, 6)
    params = SamplingParams(max_tokens=120, seed=5)
    expected = engine.generate([prompt], params)[0]
    batching = BatchingEngine(engine, max_batch=2, max_wait_ms=0)
    running = [batching.submit(prompt, params)]
    _wait_for(lambda: batching.steps_run >= 2)
    running.append(batching.submit(prompt, params))  # joins the running batch: max_batch is 2
    _wait_for(lambda: batching.batches_run == 2)
    queued = [batching.submit(prompt, params) for _ in range(3)]  # no room: these wait in the queue
    batching.close()
    for f in running:
        _same(f.result(timeout=1), expected)
    for f in queued:
        with pytest.raises(EngineClosed):
            f.result(timeout=1)
    assert not batching._thread.is_alive()


def test_counters_report_occupancy_and_busy_time(engine):
    requests = [_request(engine, i) for i in range(8)]
    with BatchingEngine(engine, max_batch=64, max_wait_ms=50) as batching:
        assert batching.counters() == {"batches_run": 0, "steps_run": 0, "rows_stepped": 0, "busy_s": 0.0}
        started = time.perf_counter()
        futures = [batching.submit(p, s) for p, s in requests]
        tokens = sum(len(f.result(timeout=60).token_ids) for f in futures)
        wall = time.perf_counter() - started
        counters = batching.counters()
    # every sampled token but each request's first (sampled from its prefill's logits) is one row of a step
    assert counters["rows_stepped"] == tokens
    assert counters["steps_run"] == batching.steps_run and counters["batches_run"] == batching.batches_run
    assert 0 < counters["busy_s"] <= wall


def test_a_vanishing_temperature_fails_its_request_only_never_with_nan_logprobs(engine):
    """Logits divided by a subnormal temperature overflow float32: every sampled logprob was NaN and came
    back as a normal generation, to be recorded for training. Now that request fails with EngineError; its
    batch mates, and the engine thread, carry on."""
    prompt = engine.render([{"role": "user", "content": "Hi"}])
    with BatchingEngine(engine, max_batch=8, max_wait_ms=50) as batching:
        bad = batching.submit(prompt, SamplingParams(temperature=1e-45, max_tokens=4, seed=1))
        mate = batching.submit(prompt, SamplingParams(max_tokens=4, seed=2))
        with pytest.raises(EngineError, match="temperature"):
            bad.result(timeout=60)
        assert all(math.isfinite(x) for x in mate.result(timeout=60).logprobs)
        later = batching.submit(prompt, SamplingParams(max_tokens=3, seed=3)).result(timeout=60)
        assert len(later.token_ids) == len(later.logprobs) > 0
    with pytest.raises(EngineError, match="temperature"):
        engine.generate([prompt], SamplingParams(temperature=1e-45, max_tokens=4, seed=1))
