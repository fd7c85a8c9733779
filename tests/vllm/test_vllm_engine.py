"""`serving.engine: vllm` through the real gateway and runner: the calc agent's rollouts served by a vLLM
server the gateway starts, the trainer's weights (whole, or a LoRA adapter) pushed after a step and verified
by hash before any rollout counts, every span recording that vLLM served it, and each recorded call replayed
against the same server (its prompt ids, sampling and seed) returning the recorded ids and logprobs. A sync
that does not take, or weights changed behind the gateway's back, stop the rollouts with a clear error and
record nothing of the wrong weights."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from lightning_dagster.gateway.options import LoraSpec
from lightning_dagster.project.examples import example_tasks
from lightning_dagster.runner.service import RolloutService
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store
from lightning_dagster.training.loss import LossConfig
from lightning_dagster.training.step import serve_policy
from lightning_dagster.training.trainer import Trainer, TrainerConfig
from lightning_dagster.types import RolloutKind, Sampling, SpanKind
from tests.support.vllm_replay import assert_replays

pytestmark = pytest.mark.vllm

LORA = LoraSpec(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
SERVING = ServingSettings(engine="vllm", max_batch=8, parallel=8)


def nudged_trainer(model_dir, lora: LoraSpec | None) -> Trainer:
    """A trainer whose trainable weights moved a little from the parent's (as after an RL step)."""
    loss = LossConfig(kl_coef=0.0, normalization="token_mean", constant=None)
    trainer = Trainer(model_dir, TrainerConfig(lr=1e-4, device="cpu", loss=loss, lora=lora))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return trainer


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return Store(f"sqlite:///{tmp_path_factory.mktemp('vllm-engine') / 'store.db'}")


@pytest.fixture(scope="module")
def service(vllm_interpreter, checkpoints, store):
    with RolloutService(store, checkpoints["base"][0], harness="calc", serving=SERVING, lora=LORA) as svc:
        yield svc


def run(service: RolloutService, tag: str, *, temperature: float = 1.0, seed: int = 7):
    tasks = example_tasks("calc").draw("train", 3, 0)
    kind = RolloutKind.train if temperature else RolloutKind.holdout
    return service.run(
        tasks, group=2, kind=kind, sampling=Sampling(temperature=temperature), seed=seed, tag=tag
    )


def llm_spans(batch) -> list:
    return [s for spans in batch.spans.values() for s in spans if s.kind == SpanKind.llm]


def test_the_parents_rollouts_are_served_by_vllm_and_replay_exactly(service, checkpoints):
    sampled, greedy = run(service, "parent"), run(service, "parent-greedy", temperature=0.0)
    spans = llm_spans(sampled) + llm_spans(greedy)
    assert len(sampled.rewards) == len(sampled.rollouts) == 6  # every rollout finished and was rewarded
    assert {s.attributes["backend"] for s in spans} == {"vllm"}
    assert {s.attributes["weights"]["hash"] for s in spans} == {checkpoints["base"][1]}
    assert {s.attributes["token_source"] for s in spans} <= {"rendered", "reused", "ids"}  # token-in
    server = service.gateway._backend.server
    assert {s.attributes["upstream"] for s in spans} == {server.base_url}  # spans name the server that served
    assert_replays(spans, server.base_url)


def test_a_lora_step_is_hot_loaded_by_name_verified_and_replays(service, checkpoints):
    trainer = nudged_trainer(checkpoints["base"][0], LORA)
    serve_policy(service, trainer, "cand@1")
    spans = llm_spans(run(service, "step-1"))
    assert {s.resource_id for s in spans} == {"cand@1"}
    assert {s.attributes["model"] for s in spans} == {"cand@1"}  # the adapter, served under its name
    assert {s.attributes["backend"] for s in spans} == {"vllm"}
    assert_replays(spans, service.gateway._backend.server.base_url)


def test_whole_weights_are_reloaded_verified_and_replay(service, checkpoints):
    from lightning_dagster.engine.build import tensors_hash

    trainer = nudged_trainer(checkpoints["base"][0], None)
    state = trainer.state_dict()
    service.load_weights(state, "cand@2")
    spans = llm_spans(run(service, "step-2"))
    assert {s.attributes["weights"]["hash"] for s in spans} == {tensors_hash(state)}
    assert {s.attributes["model"] for s in spans} == {"policy"}
    assert_replays(spans, service.gateway._backend.server.base_url)


def test_weights_changed_behind_the_gateways_back_stop_the_rollouts(service, checkpoints, store):
    """Someone reloads other weights into the server directly: the next batch is refused before any
    rollout is enqueued, and nothing is recorded as the weights the gateway last verified."""
    server = service.gateway._backend.server
    other, other_hash = checkpoints["other"]
    server.reload_weights(other, other_hash)
    before = store.count_rollouts()
    with pytest.raises(Exception, match="no longer serves the verified weights"):
        run(service, "drifted")
    assert store.count_rollouts() == before


def test_a_push_that_does_not_verify_is_an_error_and_the_verified_weights_keep_serving(service, checkpoints):
    """A checkpoint missing a layer's tensors is refused by the server; the weights verified before are put
    back and verified again, and the next rollouts are theirs."""
    base = checkpoints["base"][0]
    service.gateway._backend.server.reload_weights(*checkpoints["base"])  # undo the drift of the test before
    service.load_weights(nudged_trainer(base, None).state_dict(), "good")
    partial = {k: v for k, v in nudged_trainer(base, None).state_dict().items() if "layers.0." not in k}
    with pytest.raises(Exception, match="did not take the weights of bad"):
        service.load_weights(partial, "bad")
    spans = llm_spans(run(service, "after-bad"))
    assert {s.resource_id for s in spans} == {"good"}


def test_a_killed_server_fails_the_next_sync_with_its_name(service, checkpoints):
    os.killpg(service.gateway._backend.server.pid, signal.SIGKILL)  # the launcher's group: it and the server
    with pytest.raises(
        Exception, match="vLLM did not take the weights of after-kill: the vLLM server is not"
    ):
        service.load_weights(nudged_trainer(checkpoints["base"][0], None).state_dict(), "after-kill")
