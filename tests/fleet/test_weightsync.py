"""Weight sync across two gateway replicas (real `gateway serve` processes, embedded tiny engines) over one
PostgreSQL store: a published policy version reaches both before a rollout tagged with it is claimed; calls
in flight at the switch finish on the old weights and their spans say so; every span's weights are the ones
that sampled it (same prompt and seed: the same ids and logprobs as every other span naming that version)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_dagster.gateway.keys import attempt_key
from lightning_dagster.gateway.weightsync import publish
from lightning_dagster.store import Store
from lightning_dagster.types import Rollout, SpanKind
from tests.fleet.conftest import ADMIN, SECRET, Gateway

pytestmark = pytest.mark.postgres
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "seed": 3}


def checkpoint(model_dir: Path, out: Path, seed: int) -> Path:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def attempt(store: Store, **metadata) -> tuple[str, str]:
    (r,) = store.enqueue_rollouts([Rollout(task_id="t", metadata=metadata)])
    rollout, att = store.claim_rollout("test", rollout_ids=[r.rollout_id])
    return rollout.rollout_id, att.attempt_id


def chat(url: str, rollout_id: str, attempt_id: str) -> httpx.Response:
    key = attempt_key(SECRET, rollout_id, attempt_id)
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=60)


def served_version(url: str) -> int | None:
    state = httpx.get(f"{url}/admin/weights", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    return state.json()["weights"]["version"]


def test_a_published_version_reaches_both_replicas_before_its_rollouts_start(
    postgres_url, model_dir, tmp_path
):
    weights = tmp_path / "weights"
    v1 = checkpoint(model_dir, weights / "v1", seed=1)
    v2 = checkpoint(model_dir, weights / "v2", seed=2)
    store = Store(postgres_url)
    root = ("--model-roots", str(weights))
    replicas = [Gateway(tmp_path, postgres_url, model_dir, *root) for _ in range(2)]
    try:
        first = publish(store, v1, "res-v1")
        wait_for(lambda: store.fleet_version() == 1)
        assert [served_version(g.url) for g in replicas] == [1, 1]

        (tagged,) = store.enqueue_rollouts([Rollout(task_id="t", metadata={"policy_version": 2})])
        claimed: dict = {}

        def claim_when_ready() -> None:  # the runner's claim gate, as `Runner._next` applies it
            while True:
                ready = store.fleet_version()
                got = store.claim_rollout("w", rollout_ids=[tagged.rollout_id], policy_versions=[ready or 0])
                if got is not None:
                    claimed["versions"] = [served_version(g.url) for g in replicas]  # at the claim
                    claimed["attempt"] = got[1].attempt_id
                    return
                claimed.setdefault("waited", ready)
                time.sleep(0.05)

        stop = threading.Event()
        callers = [(g.url, *attempt(store)) for g in replicas]

        def call_until_stopped(url: str, rid: str, aid: str) -> None:
            while not stop.is_set():
                assert chat(url, rid, aid).status_code == 200

        threads = [threading.Thread(target=call_until_stopped, args=c) for c in callers]
        for t in threads:
            t.start()
        time.sleep(1.0)
        gate = threading.Thread(target=claim_when_ready)
        gate.start()
        time.sleep(0.3)
        published_at = time.time()
        second = publish(store, v2, "res-v2")
        gate.join(timeout=60)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(timeout=60)

        assert claimed["waited"] == 1  # the tagged rollout was held while the fleet served v1
        assert claimed["versions"] == [2, 2]  # and claimed only once both replicas served v2

        hashes = {1: first.weights_hash, 2: second.weights_hash}
        by_version: dict[int, list] = {1: [], 2: []}
        for url, _, aid in callers:
            spans = [s for s in store.list_spans(attempt_id=aid) if s.kind == SpanKind.llm]
            versions = [s.attributes["weights"]["version"] for s in spans]
            assert versions == sorted(versions) and set(versions) == {1, 2}, url  # one switch per replica
            for s in spans:
                w = s.attributes["weights"]
                assert (w["hash"], s.resource_id) == (hashes[w["version"]], f"res-v{w['version']}")
                by_version[w["version"]].append(s)
        # in flight when v2 was published, finished on v1 (the switch drained them) and recorded as v1
        assert any(s.end_time > published_at for s in by_version[1])
        for spans in by_version.values():  # same prompt and seed: each version has one answer
            assert all(s.response_token_ids == spans[0].response_token_ids for s in spans)
            assert all(
                s.response_logprobs == pytest.approx(spans[0].response_logprobs, abs=1e-4) for s in spans
            )
        assert by_version[1][0].response_logprobs != pytest.approx(
            by_version[2][0].response_logprobs, abs=1e-4
        )

        stale = attempt(store, policy_version=1)
        for g in replicas:
            refused = chat(g.url, *stale)
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "weights_superseded"
            assert chat(g.url, tagged.rollout_id, claimed["attempt"]).status_code == 200
        spans = [s for s in store.list_spans(attempt_id=claimed["attempt"]) if s.kind == SpanKind.llm]
        assert [s.attributes["weights"]["version"] for s in spans] == [2, 2]
    finally:
        for g in replicas:
            g.stop()
        store.close()
