"""Replays of recorded vLLM calls: a call's recorded prompt ids, sampling and seed sent straight to the vLLM
server that answered it (its span's `upstream`, the server's /v1 URL), which must return the recorded ids
and logprobs (`assert_replays`).

For the whole graph (`tests/dagster/test_vllm_pipeline.py`) a replay has to happen while the server still
serves the weights the call was sampled from: the gateway pushes the next weights into the same server (a
whole-weight reload, or an adapter under another name), and the servers of the training process and of the
rollback drill end with them. So `install` replays a sample of each batch's calls as the batch returns
(`RolloutService.run`, inside the stage, before it loads other weights), and the drill's one call as its
gateway closes, and writes each replay, or the error it met, as a JSON line to a folder of its own
(`$LD_TEST_VLLM_REPLAYS`); the test judges them (`read`). `replaying_trainer` has `candidate_resource`'s
Pipes process run this module, which installs the same hooks and then runs the usual
`lightning_dagster.orchestration.pipes_child` main.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

REPLAYS_ENV = "LD_TEST_VLLM_REPLAYS"
PER_BATCH = 2  # calls replayed per batch (and of the drill's probe, which makes one)
LOGPROB_ABS = 1e-4  # the same request alone vs in a batch: the ids are exact, logprobs agree to this
PIPES_CHILD = "lightning_dagster.orchestration.pipes_child"


def replay(span: Any, url: str | None = None) -> tuple[list[int], list[float]]:
    """The call of LLM span `span` sent again to `url` (default: the server that answered it): the recorded
    prompt ids, model (an adapter's name, with LoRA), sampling and seed. Returns its ids and logprobs."""
    a = span.attributes
    body = {
        "model": a["model"], "prompt": span.prompt_token_ids, "temperature": a["temperature"],
        "top_p": a["top_p"], "max_tokens": a["max_tokens"], "seed": a["seed"], "logprobs": 1,
        "return_token_ids": True,
    }  # fmt: skip
    response = httpx.post(f"{url or a['upstream']}/completions", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_replays(spans: list[Any], url: str | None = None) -> None:
    assert spans
    for span in spans:
        ids, logprobs = replay(span, url)
        assert ids == span.response_token_ids
        assert logprobs == pytest.approx(span.response_logprobs, abs=LOGPROB_ABS)


def sample(spans: list[Any], n: int = PER_BATCH) -> list[Any]:
    """Up to `n` of `spans`, spread from the first to the last."""
    if len(spans) <= n:
        return list(spans)
    return [spans[round(i * (len(spans) - 1) / (n - 1))] for i in range(n)] if n > 1 else spans[:1]


def vllm_calls(spans: list[Any]) -> list[Any]:
    return [
        s for s in spans
        if s.kind == "llm" and s.attributes.get("backend") == "vllm" and s.response_token_ids
    ]  # fmt: skip


def _write(folder: Path, span: Any, origin: str, url: str | None = None) -> None:
    a = span.attributes
    entry: dict[str, Any] = {
        "origin": origin, "span_id": span.span_id, "rollout_id": span.rollout_id,
        "resource_id": span.resource_id, "model": a.get("model"), "upstream": url or a.get("upstream"),
        "weights": a.get("weights"), "temperature": a.get("temperature"), "seed": a.get("seed"),
        "recorded_ids": span.response_token_ids, "recorded_logprobs": span.response_logprobs,
        "at": time.time(),
    }  # fmt: skip
    try:
        entry["ids"], entry["logprobs"] = replay(span, url)
    except Exception as exc:  # noqa: BLE001 - judged by the test, never raised into the stage
        entry["error"] = f"{type(exc).__name__}: {exc}"
    with open(folder / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(entry) + "\n")


def install(mp: pytest.MonkeyPatch, folder: Path) -> None:
    """Replay `PER_BATCH` vLLM calls of every batch, and of every in-process vLLM gateway (the drill's probe)
    as it closes, into `folder`; undone with `mp`."""
    from lightning_dagster.gateway.local import LocalGateway
    from lightning_dagster.runner.service import RolloutService

    run, close = RolloutService.run, LocalGateway.close

    def replaying_run(self, *args, **kwargs):
        batch = run(self, *args, **kwargs)
        spans = [s for r in batch.rollouts for s in batch.spans.get(r.rollout_id, [])]
        for span in sample(vllm_calls(spans)):
            _write(folder, span, "batch")
        return batch

    def replaying_close(self) -> None:
        in_process = self._process is None and self._server is not None
        if in_process and getattr(self._backend, "kind", "") == "vllm":
            store = self._server.app.state.gateway.store
            deadline = time.monotonic() + 10  # the span may still be on its way to the store
            while not (calls := vllm_calls(store.list_spans(kind="llm"))) and time.monotonic() < deadline:
                time.sleep(0.2)
            for span in sample(calls):
                _write(folder, span, "probe", self._backend.server.base_url)
        close(self)

    mp.setattr(RolloutService, "run", replaying_run)
    mp.setattr(LocalGateway, "close", replaying_close)


def replaying_trainer(mp: pytest.MonkeyPatch) -> None:
    """`candidate_resource`'s Pipes process runs this module (same argv) instead of `PIPES_CHILD`."""
    from lightning_dagster.orchestration import assets
    from lightning_dagster.training.distributed import command

    def replaying(nproc: int, module: str, *argv: str) -> list[str]:
        return command(nproc, __name__ if module == PIPES_CHILD else module, *argv)

    mp.setattr(assets, "command", replaying)


def read(folder: Path) -> list[dict[str, Any]]:
    """Every replay written to `folder`, by every process, in the order they were made."""
    entries = [json.loads(line) for f in folder.glob("*.jsonl") for line in f.read_text().splitlines()]
    return sorted(entries, key=lambda e: e["at"])


if __name__ == "__main__":
    install(pytest.MonkeyPatch(), Path(os.environ[REPLAYS_ENV]))
    from lightning_dagster.orchestration.pipes_child import main

    raise SystemExit(main(sys.argv[1]))
