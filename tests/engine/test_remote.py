"""EngineProcess: the batching engine in a child process gives every caller exactly what the in-process
engine gives, keeps a bad request from failing its neighbours, swaps weights all or nothing, and fails every
waiting caller with a clear error (never a hang) when the child dies or closes."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_dagster.engine import EngineClosed, EngineError, SamplingParams, StateDictMismatch
from lightning_dagster.engine.remote import EngineProcess
from tests.engine.test_batching import _request, _same


@pytest.fixture(scope="module")
def remote(model_dir):
    with EngineProcess(model_dir, max_batch=8, threads=1) as proc:
        yield proc


def test_concurrent_callers_get_the_in_process_engines_seeded_results(engine, remote):
    assert remote.pid != os.getpid() and remote.vocab_size == engine.vocab_size
    requests = [_request(engine, i) for i in range(24)]
    expected = [engine.generate([p], s)[0] for p, s in requests]
    barrier = threading.Barrier(12)

    def call(i: int):
        if i < 12:
            barrier.wait()  # the first twelve submit at once, more than max_batch: rows join as others leave
        prompt, params = requests[i]
        return remote.submit(prompt, params).result(timeout=120)

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(call, range(24)))
    for g, e in zip(got, expected, strict=True):
        _same(g, e)
    counters = remote.counters()
    assert counters["steps_run"] > 0 and counters["rows_stepped"] >= counters["steps_run"]
    # the text side is local: rendering in the gateway's process gives the engine's ids
    assert remote.engine.render([{"role": "user", "content": "hi"}]) == engine.render(
        [{"role": "user", "content": "hi"}]
    )


def test_a_malformed_request_fails_alone(engine, remote):
    prompt, params = _request(engine, 1)
    bad = [
        remote.submit([engine.vocab_size + 5], params),  # a token id outside the vocabulary
        remote.submit([], params),
        remote.submit(prompt, SamplingParams(temperature=-1.0)),
        remote.submit(list(range(10)) * (engine.max_length // 10 + 1), params),  # longer than the context
    ]
    good = remote.submit(prompt, params)
    for f in bad:
        with pytest.raises(EngineError):
            f.result(timeout=60)
    _same(good.result(timeout=120), engine.generate([prompt], params)[0])


def test_weights_swap_all_or_nothing(engine, remote, model_dir):
    prompt, _ = _request(engine, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = remote.submit(prompt, greedy).result(timeout=60)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    # a state dict that does not fit: refused, the old weights keep serving
    broken = dict(state)
    broken.pop(next(iter(broken)))
    broken["not.a.weight"] = torch.zeros(3)
    with pytest.raises(StateDictMismatch):
        remote.load_weights(broken)
    _same(remote.submit(prompt, greedy).result(timeout=60), before)
    # new weights (every tensor scaled): served from the next request on, as the in-process engine does
    scaled = {k: v * 0.5 if v.is_floating_point() else v for k, v in state.items()}
    remote.load_weights(scaled)
    try:
        engine.load_weights(scaled)
        _same(remote.submit(prompt, greedy).result(timeout=60), engine.generate([prompt], greedy)[0])
    finally:
        engine.load_weights(state)
        remote.load_weights(state)
    _same(remote.submit(prompt, greedy).result(timeout=60), before)
    with pytest.raises(StateDictMismatch, match="cannot read weights"):
        remote.load_weights_file(model_dir / "no-such.safetensors")


def test_a_dead_child_fails_waiting_and_later_callers_with_its_exit(engine, model_dir):
    proc = EngineProcess(model_dir, max_batch=4, threads=1)
    prompt, _ = _request(engine, 3)
    long = SamplingParams(temperature=1.0, max_tokens=4000, seed=1)
    waiting = [proc.submit(prompt, long) for _ in range(6)]
    os.kill(proc.pid, signal.SIGKILL)
    for f in waiting:
        with pytest.raises(EngineClosed, match="exited"):
            f.result(timeout=60)
    with pytest.raises(EngineClosed, match="exited"):
        proc.submit(prompt, long).result(timeout=5)
    with pytest.raises(EngineClosed):
        proc.counters()
    proc.close()
    proc.close()  # idempotent


def test_close_finishes_what_runs_and_refuses_what_comes_after(engine, model_dir):
    proc = EngineProcess(model_dir, max_batch=2, threads=1)
    requests = [_request(engine, i) for i in range(6)]
    futures = [proc.submit(p, s) for p, s in requests]
    proc.close()
    for f, (p, s) in zip(futures, requests, strict=True):
        # each either ran to the end (its exact result) or was refused as queued at close: never lost
        try:
            _same(f.result(timeout=5), engine.generate([p], s)[0])
        except EngineClosed:
            pass
    with pytest.raises(EngineClosed):
        proc.submit(*requests[0]).result(timeout=5)


def test_a_model_that_does_not_load_is_a_start_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception) as err:
        EngineProcess(tmp_path, threads=1)
    assert "config" in str(err.value).lower() or "tokenizer" in str(err.value).lower()
