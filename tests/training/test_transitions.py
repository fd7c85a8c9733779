"""The merge invariant, dedupe, prefix breaks, per-call mode and length limits, on hand-built spans."""

from __future__ import annotations

import pytest

from lightning_dagster.training.transitions import (
    MissingTemperature,
    Row,
    TransitionConfig,
    TransitionError,
    build_rows,
    merge_calls,
)
from lightning_dagster.types import Span, SpanKind


def llm(
    seq: int,
    prompt: list[int],
    response: list[int],
    *,
    finish: str = "stop",
    attempt: str = "at-1",
    temperature: float = 1.0,
) -> Span:
    return Span(
        rollout_id="ro-1",
        attempt_id=attempt,
        sequence=seq,
        kind=SpanKind.llm,
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=[-0.1 * (seq + 1) - 0.01 * i for i in range(len(response))],
        finish_reason=finish,
        attributes={"temperature": temperature},
    )


def agent_trace(turns: int, attempt: str = "at-1") -> list[Span]:
    """A token-in trace: each prompt = previous prompt + response + a tool delta."""
    spans, prompt = [], [1, 2, 3, 4]
    for k in range(turns):
        response = [100 + 10 * k + i for i in range(3)]
        spans.append(llm(k, list(prompt), response, attempt=attempt))
        prompt = prompt + response + [7, 8 + k]
    return spans


def assert_invariant(row: Row, calls: list[Span]) -> None:
    """The docstring's invariant: each merged call is an exact prefix of the row; sampled tokens have mask
    1 and their recorded logprobs; all other response tokens have mask 0 and logprob 0."""
    full = row.prompt_ids + row.response_ids
    sampled: dict[int, float] = {}
    for c in calls:
        assert c.span_id in row.span_ids
        history = c.prompt_token_ids + c.response_token_ids
        assert full[: len(history)] == history
        start = len(c.prompt_token_ids) - len(row.prompt_ids)
        for j, lp in enumerate(c.response_logprobs):
            sampled[start + j] = lp
    for j, (m, lp) in enumerate(zip(row.loss_mask, row.behaviour_logprobs, strict=True)):
        if j in sampled:
            assert m == 1 and lp == sampled[j]
        else:
            assert m == 0 and lp == 0.0
    assert row.prompt_ids == calls[0].prompt_token_ids


def test_token_in_trace_merges_into_one_row_holding_the_invariant():
    spans = agent_trace(5)
    rows, stats = merge_calls(spans)
    assert len(rows) == 1 and stats.bridges == 4 and not stats.mismatches
    assert stats.single_row_attempts == 1 and stats.mismatch_rate == 0.0
    assert_invariant(rows[0], spans)
    assert rows[0].trained_tokens == 15


def test_edited_history_gives_two_rows_and_one_counted_mismatch_with_context():
    spans = agent_trace(3)
    edited = list(spans[2].prompt_token_ids)
    edited[6] = 999  # the harness rewrote one token of the first response in its history
    spans[2] = llm(2, edited, [120, 121])
    rows, stats = merge_calls(spans)
    assert len(rows) == 2
    assert len(stats.mismatches) == 1 and stats.mismatch_rate == 0.5
    mm = stats.mismatches[0]
    assert mm.position == 6 and mm.call_index == 2
    assert 999 in mm.actual and 999 not in mm.expected and len(mm.expected) == 9
    assert "token 6" in mm.describe()
    assert_invariant(rows[0], spans[:2])
    assert_invariant(rows[1], spans[2:])
    assert rows[0].loss_mask[3:5] == [0, 0]  # the tool delta between the two merged calls


def test_duplicate_prompts_keep_the_last_call():
    spans = agent_trace(2)
    retry = llm(5, list(spans[0].prompt_token_ids), [100, 101, 102])  # a client retry of the first call
    spans = [spans[0], retry, spans[1]]
    for i, s in enumerate(spans):
        s.sequence = i
    rows, stats = merge_calls(spans)
    assert stats.duplicates == 1 and len(rows) == 1
    assert rows[0].span_ids == [retry.span_id, spans[2].span_id]


def test_per_call_mode_gives_one_row_per_call():
    spans = agent_trace(4)
    rows, stats = merge_calls(spans, TransitionConfig(mode="per_call"))
    assert len(rows) == 4 and stats.bridges == 0 and not stats.mismatches
    for row, call in zip(rows, spans, strict=True):
        assert_invariant(row, [call])
        assert row.loss_mask == [1] * len(call.response_token_ids)


def test_length_finish_is_not_bridged():
    spans = agent_trace(3)
    spans[0].finish_reason = "length"
    rows, stats = merge_calls(spans)
    assert len(rows) == 2 and stats.length_splits == 1 and not stats.mismatches
    assert_invariant(rows[1], spans[1:])


def test_long_first_prompt_dropped_and_response_tail_truncated_with_mask_and_logprobs():
    spans = agent_trace(3)
    rows, stats = merge_calls(spans, TransitionConfig(max_prompt_tokens=3))
    assert rows == [] and stats.dropped_long_prompt == 1
    rows, stats = merge_calls(spans, TransitionConfig(max_response_tokens=7))
    (row,) = rows
    full, _ = merge_calls(spans)
    assert row.truncated and stats.truncated_rows == 1
    assert row.response_ids == full[0].response_ids[:7]
    assert row.loss_mask == full[0].loss_mask[:7]
    assert row.behaviour_logprobs == full[0].behaviour_logprobs[:7]


def test_build_rows_groups_by_attempt_and_ignores_other_span_kinds():
    spans = agent_trace(3, "at-a") + agent_trace(2, "at-b")
    spans.insert(1, Span(rollout_id="ro-1", attempt_id="at-a", sequence=1, kind=SpanKind.tool, name="calc"))
    rows, stats = build_rows(spans)
    assert [r.attempt_id for r in rows] == ["at-a", "at-b"]
    assert stats.attempts == 2 and stats.calls == 5 and stats.single_row_attempts == 2


def test_llm_span_without_tokens_is_a_named_error():
    bad = Span(rollout_id="ro-1", attempt_id="at-1", kind=SpanKind.llm, prompt_token_ids=[1])
    with pytest.raises(TransitionError):
        merge_calls([bad])


def test_rows_carry_the_temperature_their_calls_were_sampled_at():
    spans = agent_trace(3)
    for s in spans:
        s.attributes["temperature"] = 0.7
    (row,), _ = merge_calls(spans)
    assert row.temperature == 0.7


def test_a_call_at_another_temperature_starts_a_counted_new_row():
    spans = agent_trace(4)
    spans[2].attributes["temperature"] = 0.0  # e.g. a greedy call in the middle of a sampled attempt
    spans[3].attributes["temperature"] = 0.0
    rows, stats = merge_calls(spans)
    assert [r.temperature for r in rows] == [1.0, 0.0]
    assert [r.span_ids for r in rows] == [
        [spans[0].span_id, spans[1].span_id],
        [spans[2].span_id, spans[3].span_id],
    ]
    assert stats.temperature_splits == 1 and stats.bridges == 2 and not stats.mismatches
    assert stats.to_dict()["temperature_splits"] == 1
    assert_invariant(rows[0], spans[:2])
    assert_invariant(rows[1], spans[2:])


@pytest.mark.parametrize(
    "attributes",
    [
        {},
        {"temperature": None},
        {"temperature": "1.0"},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
    ],
)
def test_llm_span_without_a_recorded_temperature_is_a_named_error(attributes):
    spans = agent_trace(2)
    spans[1].attributes = attributes
    with pytest.raises(MissingTemperature, match=spans[1].span_id):
        merge_calls(spans)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 0.5])
def test_a_logprob_no_sampler_could_record_is_a_named_error(bad):
    """A NaN or infinite behaviour logprob would turn the step's importance weights, loss and weights into
    NaN; a positive one is no probability. The merge refuses the span, naming it."""
    spans = agent_trace(2)
    spans[1].response_logprobs = [bad, *spans[1].response_logprobs[1:]]
    with pytest.raises(TransitionError, match=spans[1].span_id):
        merge_calls(spans)


@pytest.mark.parametrize(("prompt", "response"), [([1, -3, 2], [4, 5]), ([1, 2], [4, -1]), ([], [4, 5])])
def test_negative_ids_or_an_empty_prompt_are_a_named_error(prompt, response):
    """Negative ids index nothing in the model (a crash deep in torch's embedding); an empty prompt has no
    position to predict the first response token from."""
    span = llm(0, prompt, response)
    with pytest.raises(TransitionError, match=span.span_id):
        merge_calls([span])
