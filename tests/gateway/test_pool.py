"""Gateway children reused across stages (`gateway.pool`): a reused child serves the next model's weights
exactly as a fresh child of that model would, only a model of the same family reuses one, a dead or busy
child is never handed out, and every parked child is stopped in the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_dagster.gateway import GatewayKeys, attempt_key, gateway_options
from lightning_dagster.gateway.local import LocalGateway
from lightning_dagster.gateway.pool import POOL, GatewayPool, model_family
from lightning_dagster.settings import ServingSettings
from lightning_dagster.types import Rollout, RolloutKind

IN_PROCESS_ENGINE = gateway_options(ServingSettings(engine_process=False))

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 5}


@pytest.fixture
def twin(model_dir, tmp_path) -> Path:
    """A checkpoint of the same family as `model_dir` (config, tokenizer) with other weights."""
    out = tmp_path / "twin"
    shutil.copytree(model_dir, out)
    gen = torch.Generator().manual_seed(1)
    weights = {
        k: v + 0.5 * torch.randn(v.shape, generator=gen)
        for k, v in load_file(out / "model.safetensors").items()
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture
def empty_pool():
    POOL.clear()
    yield POOL
    POOL.clear()


def _call(gw: LocalGateway, store) -> tuple[list[int], list[float], str | None]:
    """One seeded chat call through `gw` as a harness makes it: (response ids, logprobs, resource)."""
    (rollout,) = store.enqueue_rollouts([Rollout(kind=RolloutKind.train)])
    _, attempt = store.claim_rollout("w", rollout_ids=[rollout.rollout_id])
    key = attempt_key(gw.secret, rollout.rollout_id, attempt.attempt_id)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    client.chat.completions.create(**CHAT)
    (span,) = store.list_spans(attempt_id=attempt.attempt_id, kind="llm")
    return span.response_token_ids, span.response_logprobs, span.resource_id


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers signal 0: it has exited, its parent has not reaped it yet
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(") ")[1].startswith("Z")


def test_the_next_stage_takes_the_child_and_serves_its_own_weights_as_a_fresh_child_would(
    store, model_dir, twin, tmp_path, empty_pool
):
    with LocalGateway(store, twin, IN_PROCESS_ENGINE, child=True, resource_id="twin") as fresh:  # no reuse
        expected = _call(fresh, store)
        fresh_pid = fresh.pid
    assert _dead(fresh_pid) and empty_pool.idle() == 0, "without reuse the child stops on close"

    with LocalGateway(
        store, model_dir, IN_PROCESS_ENGINE, child=True, reuse=True, resource_id="base"
    ) as first:
        pid = first.pid
        from_base = _call(first, store)
    assert not _dead(pid) and empty_pool.idle() == 1, "a reusing gateway parks its child"
    with LocalGateway(store, twin, IN_PROCESS_ENGINE, child=True, reuse=True, resource_id="twin") as second:
        assert second.pid == pid and empty_pool.idle() == 0, "taken, not shared"
        got = _call(second, store)
    assert from_base[2] == "base" and from_base[:2] != expected[:2]
    assert got == expected, "the reused child samples the twin's tokens and logprobs exactly"

    # another family (a changed config) starts its own child; an explicit secret never reuses
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "note": "another family"}))
    assert model_family(other) != model_family(model_dir)
    with LocalGateway(store, other, IN_PROCESS_ENGINE, child=True, reuse=True) as third:
        assert third.pid != pid
        third_pid = third.pid
    own_keys = GatewayKeys.fresh("s" * 32)
    with LocalGateway(store, twin, IN_PROCESS_ENGINE, keys=own_keys, child=True, reuse=True) as own_secret:
        assert own_secret.pid not in (pid, third_pid)
        own_pid = own_secret.pid
    assert _dead(own_pid) and empty_pool.idle() == 2

    # a parked child that died is never handed out: the next stage starts a new one
    os.kill(pid, signal.SIGKILL)
    with LocalGateway(store, twin, IN_PROCESS_ENGINE, child=True, reuse=True, resource_id="twin") as fourth:
        assert fourth.pid not in (pid, third_pid)
        assert _call(fourth, store) == expected
        last = fourth.pid
    empty_pool.clear()
    assert empty_pool.idle() == 0 and _dead(third_pid) and _dead(last)


def test_a_checkpoint_without_one_safetensors_file_has_no_family(model_dir, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(model_dir, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    assert model_family(sharded) is None
    assert model_family(model_dir) == model_family(model_dir)


class FakeChild:
    def __init__(self) -> None:
        self.stopped = self.terminated = self.dead = False

    def alive(self) -> bool:
        return not self.dead

    def stop(self) -> None:
        self.stopped = True

    def terminate(self) -> None:
        self.terminated = True


def test_the_pool_keeps_at_most_max_idle_children_and_stops_the_oldest():
    pool = GatewayPool(max_idle=2)
    children = [FakeChild() for _ in range(3)]
    for child in children:
        pool.park("k", child)  # type: ignore[arg-type]
    assert [c.stopped for c in children] == [True, False, False]
    assert pool.take("other") is None
    assert pool.take("k") is children[1] and pool.idle() == 1
    children[2].dead = True
    assert pool.take("k") is None and children[2].stopped, "a dead child is stopped, not handed out"
    dead = FakeChild()
    dead.dead = True
    pool.park("k", dead)  # type: ignore[arg-type]
    assert dead.stopped and pool.idle() == 0
    last = [FakeChild(), FakeChild()]
    pool.park("a", last[0])  # type: ignore[arg-type]
    pool.park("b", last[1])  # type: ignore[arg-type]
    pool.clear()
    assert pool.idle() == 0 and all(c.terminated and c.stopped for c in last)


def test_concurrent_takes_hand_one_child_to_one_taker():
    pool = GatewayPool(max_idle=2)
    child = FakeChild()
    pool.park("k", child)  # type: ignore[arg-type]
    got: list[object] = []
    barrier = threading.Barrier(8)

    def take() -> None:
        barrier.wait()
        got.append(pool.take("k"))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [g for g in got if g is not None] == [child]


@pytest.mark.parametrize("serving", ["thread", "process"])
def test_an_engine_in_its_own_process_serves_what_the_in_process_engine_serves(
    store, model_dir, twin, serving, empty_pool
):
    """`engine_process`: the same seeded call gives the same tokens and logprobs as the engine inside the
    gateway, before and after a weight push; a dead engine process turns calls into a 503 that says so."""
    from safetensors.torch import load_file

    def calls(gw: LocalGateway) -> list:
        out = [_call(gw, store)]
        gw.load_weights(load_file(twin / "model.safetensors"), "twin")
        out.append(_call(gw, store))
        return out

    child = serving == "process"
    with LocalGateway(store, model_dir, IN_PROCESS_ENGINE, child=child, resource_id="base") as inside:
        expected = calls(inside)
    with LocalGateway(
        store, model_dir, child=child, resource_id="base"
    ) as split:  # engine_process: the default
        assert calls(split) == expected
        assert expected[0][2] == "base" and expected[1][2] == "twin" and expected[0][0] != expected[1][0]
        assert split.stats()["engine"]["steps_run"] > 0
        if serving == "thread":
            os.kill(split._batching.pid, signal.SIGKILL)
            (rollout,) = store.enqueue_rollouts([Rollout(kind=RolloutKind.train)])
            _, attempt = store.claim_rollout("w", rollout_ids=[rollout.rollout_id])
            key = attempt_key(split.secret, rollout.rollout_id, attempt.attempt_id)
            client = openai.OpenAI(base_url=split.url + "/v1", api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(**CHAT)
            assert err.value.status_code == 503 and "engine process exited" in err.value.message
