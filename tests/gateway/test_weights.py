"""Weight pushes: `POST /admin/weights` swaps the engine's weights from a safetensors file and changes the
resource recorded on spans; every bad push is a 4xx that leaves the old weights serving. `GatewayProcess`
runs the same gateway in a child process that a trainer feeds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from lightning_dagster.engine import BatchingEngine, Engine
from lightning_dagster.gateway import EngineBackend, GatewayKeys, attempt_key, gateway_options
from lightning_dagster.gateway.process import GatewayProcess, GatewayProcessError
from lightning_dagster.gateway.upstreams import UpstreamBackend
from lightning_dagster.settings import ServingSettings
from lightning_dagster.types import Rollout, RolloutKind
from tests.gateway.conftest import ADMIN, Gateway, _serve

CHILD = gateway_options(ServingSettings(engine_process=False))  # the gateway child with its engine inside
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 3}


def _post(url: str, key: str, body=None, content: bytes | None = None) -> httpx.Response:
    headers = {"content-type": "application/json", "Authorization": f"Bearer {key}"}
    return httpx.post(url, headers=headers, json=body, content=content, timeout=60)


def _perturbed(engine: Engine, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        k: (v + scale * torch.randn(v.shape, generator=gen)).contiguous()
        for k, v in engine.model.state_dict().items()
        if k != "lm_head.weight"  # tied to the embeddings: safetensors stores the pair once
    }


@pytest.fixture
def own_gateway(store, model_dir, tmp_path):
    """A gateway over an engine of its own (pushes must not change the session engine other tests use),
    reading weights from `tmp_path` only."""
    engine = Engine(model_dir)
    batching = BatchingEngine(engine, max_batch=4)
    with _serve(store, EngineBackend(batching, resource_id="res-0"), model_roots=[tmp_path]) as server:
        yield Gateway(server, store, server.url), engine
    batching.close()


def test_a_weight_push_changes_the_samples_and_the_resource_on_later_spans(own_gateway, tmp_path):
    gw, engine = own_gateway
    _, aid, key = gw.attempt()
    before = gw.client(key).chat.completions.create(**CHAT)
    path = tmp_path / "w.safetensors"
    save_file(_perturbed(engine, 0.5), str(path))
    pushed = _post(gw.url + "/admin/weights", ADMIN, {"path": str(path), "resource_id": "res-1"})
    assert pushed.status_code == 200, pushed.text
    assert pushed.json()["resource_id"] == "res-1"
    after = gw.client(key).chat.completions.create(**CHAT)
    spans = gw.spans(aid)
    assert [s.resource_id for s in spans] == ["res-0", "res-1"]
    # same prompt, same seed: only the weights differ, so the recorded logprobs must too
    assert spans[0].response_logprobs != spans[1].response_logprobs
    assert before.model == "res-0" and after.model == "res-1"


def test_bad_pushes_get_4xx_and_the_old_weights_keep_serving(own_gateway, tmp_path):
    gw, engine = own_gateway
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    url = gw.url + "/admin/weights"
    _, _, key = gw.attempt()
    assert _post(url, key, {"path": "/x"}).status_code == 403  # an attempt key is not an admin key
    assert httpx.post(url, json={"path": "/x"}).status_code == 401
    missing = _post(url, ADMIN, {"path": str(tmp_path / "nope.safetensors")})
    assert missing.status_code == 400 and "cannot read weights" in missing.json()["error"]["message"]
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    assert _post(url, ADMIN, {"path": str(garbage)}).status_code == 400
    wrong = _perturbed(engine, 0.1)
    wrong["model.norm.weight"] = torch.ones(7)
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    misfit = _post(url, ADMIN, {"path": str(tmp_path / "wrong.safetensors")})
    assert misfit.status_code == 400 and "do not fit" in misfit.json()["error"]["message"]
    assert _post(url, ADMIN, content=b"{not json").status_code in (400, 422)
    assert _post(url, ADMIN, {"path": ""}).status_code in (400, 422)
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, original[k]), k
    assert (
        httpx.get(gw.url + "/admin/health", headers={"Authorization": f"Bearer {ADMIN}"}).json()["model"]
        == "res-0"
    )


def test_weights_outside_the_model_roots_are_refused_even_through_a_link(own_gateway, tmp_path_factory):
    gw, engine = own_gateway
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "w.safetensors"
    save_file(_perturbed(engine, 0.5), str(elsewhere))
    root = gw.server.app.state.gateway.model_roots[0]
    link = root / "link.safetensors"
    link.symlink_to(elsewhere)
    url = gw.url + "/admin/weights"
    for path in (str(elsewhere), str(link), str(root / ".." / elsewhere.parent.name / "w.safetensors")):
        refused = _post(url, ADMIN, {"path": path})
        assert refused.status_code == 403, path
        assert refused.json()["error"]["param"] == "path" and "outside the model roots" in refused.text
    assert all(torch.equal(v, original[k]) for k, v in engine.model.state_dict().items())


def test_an_upstream_backend_refuses_weight_pushes_with_409(store, tmp_path):
    with _serve(store, UpstreamBackend("http://127.0.0.1:9/v1", "", "m"), model_roots=[tmp_path]) as server:
        refused = _post(server.url + "/admin/weights", ADMIN, {"path": str(tmp_path / "w.safetensors")})
    assert refused.status_code == 409 and "cannot load weights" in refused.json()["error"]["message"]


# -- the gateway in its own process ------------------------------------------------------------------------


def test_gateway_process_serves_attempts_and_takes_pushed_weights(store, model_dir):
    secret = "process-secret-0123"
    engine = Engine(model_dir)  # only to build weights to push
    with GatewayProcess(store.url, model_dir, CHILD, GatewayKeys.fresh(secret), resource_id="res-a") as proc:
        (rollout,) = store.enqueue_rollouts([Rollout(kind=RolloutKind.train)])
        _, attempt = store.claim_rollout("w", rollout_ids=[rollout.rollout_id])
        key = attempt_key(secret, rollout.rollout_id, attempt.attempt_id)
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key=key, max_retries=0, timeout=60)
        client.chat.completions.create(**CHAT)
        proc.load_weights(engine.model.state_dict(), "res-b")  # tied weights included: deduplicated
        proc.load_weights(_perturbed(engine, 0.5), "res-c")
        client.chat.completions.create(**CHAT)
        spans = store.list_spans(attempt_id=attempt.attempt_id, kind="llm")
        assert [s.resource_id for s in spans] == ["res-a", "res-c"]
        assert spans[0].response_logprobs != spans[1].response_logprobs
        bad = dict(_perturbed(engine, 0.1), **{"model.norm.weight": torch.ones(3)})
        with pytest.raises(GatewayProcessError, match="do not fit"):
            proc.load_weights(bad, "res-d")
        workdir, child = proc.workdir, proc._proc
    assert child.poll() is not None, "stopping must end the child"
    assert not workdir.exists(), "stopping removes the pushed weights"


def test_gateway_process_that_cannot_start_says_why(store, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(GatewayProcessError, match="exited with status"):
        GatewayProcess(store.url, tmp_path / "empty", CHILD, GatewayKeys.fresh())


def test_gateway_process_exits_with_the_process_that_started_it(store, model_dir, tmp_path):
    """A trainer killed with SIGKILL runs no cleanup: the child notices it was orphaned and stops."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from lightning_dagster.gateway import GatewayKeys, gateway_options
        from lightning_dagster.gateway.process import GatewayProcess
        from lightning_dagster.settings import ServingSettings
        options = gateway_options(ServingSettings(engine_process=False))
        p = GatewayProcess({store.url!r}, {str(model_dir)!r}, options, GatewayKeys.fresh())
        print(p._proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            # a zombie of an orphan is reaped by init; /proc shows whether it still runs
            status = open(f"/proc/{child}/status").read() if os.path.exists(f"/proc/{child}") else ""
            if "zombie" in status:
                break
            time.sleep(0.2)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the gateway process outlived its parent by 30 s")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_gateway_process_retries_when_its_port_is_taken_before_the_child_binds(store, model_dir, monkeypatch):
    """The port is picked by the parent and bound by the child; a process that takes it in between (here:
    a socket that listens and never answers) makes that start fail, and the next start uses another port."""
    from lightning_dagster.gateway import process

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    real = process._free_port
    monkeypatch.setattr(process, "_free_port", lambda host: next(ports, None) or real(host))
    try:
        with GatewayProcess(store.url, model_dir, CHILD, GatewayKeys.fresh()) as proc:
            assert proc.port != taken
            assert (
                httpx.get(
                    proc.url + "/admin/health", headers={"Authorization": f"Bearer {proc.admin_key}"}
                ).json()["status"]
                == "ok"
            )
    finally:
        squatter.close()
