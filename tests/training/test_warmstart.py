"""Demonstrations rendered through the engine's chat template: only assistant tokens (with their end-of-turn
token) are trained, and the rows are exactly the rendered conversation."""

from __future__ import annotations

import pytest

from lightning_dagster.engine.engine import Engine
from lightning_dagster.harnesses.calc import demos
from lightning_dagster.harnesses.registry import get_harness
from lightning_dagster.training.warmstart import DemoRenderError, demo_row, demo_rows


@pytest.fixture(scope="module")
def engine(base_model_dir) -> Engine:
    return Engine(base_model_dir)


def test_demo_rows_train_exactly_the_assistant_turns(engine):
    (task,) = get_harness("calc").make_tasks("train", 1, 3)
    messages = demos.demo_messages(task)
    row = demo_row(engine, messages, demos.demo_tools(), engine.eos_token_ids)
    full = engine.render(messages, demos.demo_tools(), add_generation_prompt=False)
    assert row.prompt_ids == engine.render(messages[:2], demos.demo_tools())
    assert (row.prompt_ids + row.response_ids) == full[: len(row)]
    trained = [t for t, m in zip(row.response_ids, row.loss_mask, strict=True) if m]
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert trained.count(im_end) == 2 and trained[-1] == im_end  # both assistant turns end with EOS
    text = engine.decode(trained)
    assert text.startswith("<tool_call>") and task["expression"] in text
    assert text.endswith(f"ANSWER: {task['answer']}")
    untrained = engine.decode([t for t, m in zip(row.response_ids, row.loss_mask, strict=True) if not m])
    assert "tool" in untrained and "ANSWER" not in untrained  # the tool result and headers are not trained


def test_demo_without_assistant_turn_is_a_named_error(engine):
    with pytest.raises(DemoRenderError):
        demo_row(engine, [{"role": "user", "content": "hi"}], None, engine.eos_token_ids)


def test_demo_rows_are_deterministic(engine):
    a = demo_rows(engine, "calc", 5, seed=1)
    b = demo_rows(engine, "calc", 5, seed=1)
    assert [r.response_ids for r in a] == [r.response_ids for r in b] and len(a) == 5


def test_warm_start_probes_through_the_runner_and_registers_the_parent(tmp_path, base_model_dir):
    from lightning_dagster.engine.build import checkpoint_hash
    from lightning_dagster.store import Store
    from lightning_dagster.training.warmstart import WarmStartConfig, warm_start

    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    config = WarmStartConfig(
        max_steps=3, min_steps=2, probe_tasks=4, demos=16, batch_size=4, window=(0.0, 1.0), target=None
    )
    result = warm_start(store, base_model_dir, tmp_path / "warm", config)
    assert result.steps == 2  # the first probe (at min_steps) already lands in a window starting at 0
    assert [m["step"] for m in result.history if "probe_success" in m] == [2]
    assert len(store.query_rollouts(kind="train")) == 4
    stored = store.get_resource(result.resource.resource_id)
    assert stored.uri == str(result.model_dir) and stored.weights_hash == checkpoint_hash(result.model_dir)
    assert stored.metadata["role"] == "warm_start" and stored.metadata["sft_steps"] == 2
    assert Engine(result.model_dir).render([{"role": "user", "content": "hi"}])  # a loadable HF checkpoint


def test_warm_start_keeps_training_until_its_target_or_max_steps(tmp_path, base_model_dir):
    from lightning_dagster.store import Store
    from lightning_dagster.training.warmstart import WarmStartConfig, warm_start

    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    config = WarmStartConfig(
        max_steps=3, min_steps=2, probe_tasks=4, demos=16, batch_size=4, window=(0.0, 1.0), target=1.01
    )
    result = warm_start(store, base_model_dir, tmp_path / "warm", config)
    # inside the window from the first probe, but short of an unreachable target: every step runs
    assert result.steps == 3
    assert [m["step"] for m in result.history if "probe_success" in m] == [2, 3]
