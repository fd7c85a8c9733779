"""BatchingEngine: concurrent submitters share batched generate calls and each gets its own exact result."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lightning_dagster.engine import BatchingEngine, EngineClosed, EngineError, SamplingParams


def _request(engine, i: int) -> tuple[list[int], SamplingParams]:
    prompt = engine.render(
        [{"role": "user", "content": f"Ann has {i} apples and buys {i + 3} more." * (1 + i % 3)}]
    )
    return prompt, SamplingParams(
        temperature=[1.0, 0.7, 0.0][i % 3], top_p=[1.0, 0.9][i % 2], max_tokens=6 + i, seed=i
    )


def test_sixteen_threads_get_their_unbatched_seeded_results(engine):
    requests = [_request(engine, i) for i in range(16)]
    expected = [engine.generate([p], s)[0] for p, s in requests]
    barrier = threading.Barrier(16)

    def call(i: int):
        barrier.wait()  # all submit at once, so they must share batches
        return batching.submit(*requests[i]).result(timeout=60)

    with BatchingEngine(engine, max_batch=64, max_wait_ms=50) as batching:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(call, range(16)))
        batches = batching.batches_run
    assert batches < 16
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids and g.text == e.text and g.finish_reason == e.finish_reason
        assert g.prompt_token_ids == e.prompt_token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs, strict=True)) < 1e-5


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


def test_a_failure_inside_generate_fails_only_its_request(engine, monkeypatch):
    """If generate raises for a batch, each request is retried alone, so only the culprit fails."""
    real = engine.generate
    poison = [5, 5, 5]

    def flaky(prompts, params):
        if poison in prompts:
            raise EngineError("poisoned prompt")
        return real(prompts, params)

    monkeypatch.setattr(engine, "generate", flaky)
    prompt, params = _request(engine, 2)
    with BatchingEngine(engine, max_wait_ms=100) as batching:
        futures = [batching.submit(poison, params), batching.submit(prompt, params)]
        with pytest.raises(EngineError, match="poisoned"):
            futures[0].result(timeout=30)
        assert futures[1].result(timeout=30).token_ids == real([prompt], params)[0].token_ids


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
