"""Training rows from recorded LLM spans, without re-tokenizing: one pure function per attempt.

`merge_calls` is the whole idea. Its invariant, tested directly in tests/training/test_transitions.py:

    For every row and every call k merged into it, in order,
        row.prompt_ids + row.response_ids[: end_k]  ==  call_k.prompt + call_k.response   (token for token)
    where end_k is where call k's response ends inside the row. Tokens a call sampled carry loss mask 1 and
    exactly the logprob the engine recorded for them; every other response token (tool output, template
    tokens between turns) carries mask 0 and logprob 0.

Calls are bridged only when `prompt[k+1]` starts with `prompt[k] + response[k]` and both were sampled at
the same temperature (the span's `attributes["temperature"]`, which the row keeps for the trainer). Anything
else (an edited history, a drifted re-rendered prompt, a call cut off by `finish_reason == "length"`)
starts a new row, counted in `MergeStats` (a prefix break as a `PrefixMismatch`).

A span no engine could have recorded raises `TransitionError`; `merge_rollouts` leaves such a rollout out
whole and refuses the step (`TooManyExcludedRollouts`) past `max_excluded_share`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from lightning_dagster.types import Span, SpanKind

MergeMode = Literal["merged", "per_call"]


class TransitionError(ValueError):
    """An LLM span lacks the token fields a training row needs, or holds values no engine samples."""

    def __init__(self, message: str, *, span_id: str = "", rollout_id: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.span_id, self.rollout_id, self.reason = span_id, rollout_id, reason or message


class MissingTemperature(TransitionError):
    """An LLM span without its sampling temperature: guessing 1.0 would train on a wrong ratio."""


def _invalid(span: Span, reason: str, kind: type[TransitionError] = TransitionError) -> TransitionError:
    return kind(
        f"span {span.span_id}: {reason}", span_id=span.span_id, rollout_id=span.rollout_id, reason=reason
    )


class TooManyExcludedRollouts(ValueError):
    """More of a batch's rollouts hold an invalid span than `max_excluded_share` allows, or none is left."""

    def __init__(
        self, message: str, *, excluded: Sequence[ExcludedRollout] = (), considered: int = 0
    ) -> None:
        super().__init__(message)
        self.excluded, self.considered = list(excluded), considered


def _too_many(excluded: Sequence[ExcludedRollout], considered: int, limit: float) -> TooManyExcludedRollouts:
    shown = "; ".join(e.describe() for e in excluded[:3])
    more = f" (and {len(excluded) - 3} more)" if len(excluded) > 3 else ""
    left = "none is left to train on" if len(excluded) >= considered else f"more than the {limit:.0%} allowed"
    return TooManyExcludedRollouts(
        f"{len(excluded)} of {considered} rollouts have an invalid span and were excluded, {left}: "
        f"{shown}{more}",
        excluded=excluded,
        considered=considered,
    )


@dataclass(frozen=True)
class TransitionConfig:
    mode: MergeMode = "merged"
    max_prompt_tokens: int | None = None  # a row whose first prompt is longer is dropped (counted)
    max_response_tokens: int | None = None  # a row's response past this is truncated (mask and logprobs too)
    context: int = 4  # ids shown on either side of a mismatch


@dataclass
class Row:
    """One training sequence: `prompt_ids` is never trained; `response_ids` carries the mask and the
    behaviour logprobs position by position."""

    rollout_id: str
    attempt_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    temperature: float  # what every sampled token of the row was sampled at (0: greedy)
    span_ids: list[str]  # the calls merged into this row, in order
    truncated: bool = False

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class PrefixMismatch:
    """Call `call_index`'s prompt does not extend the previous call's prompt + response."""

    rollout_id: str
    attempt_id: str
    span_id: str
    call_index: int
    position: int  # first differing token index (or the shorter length when one is a prefix of the other)
    expected: tuple[int, ...]  # previous prompt + response around `position`
    actual: tuple[int, ...]  # this prompt around `position`

    def describe(self) -> str:
        return (
            f"{self.attempt_id} call {self.call_index}: prefix break at token {self.position}: "
            f"expected ...{list(self.expected)}... got ...{list(self.actual)}..."
        )


@dataclass(frozen=True)
class ExcludedRollout:
    """A rollout left out of a step because one of its spans is invalid (the first one found)."""

    rollout_id: str
    span_id: str
    reason: str

    def describe(self) -> str:
        return f"rollout {self.rollout_id} span {self.span_id}: {self.reason}"


@dataclass
class MergeStats:
    attempts: int = 0
    calls: int = 0
    duplicates: int = 0
    rows: int = 0
    bridges: int = 0  # calls appended to the previous call's row
    length_splits: int = 0  # calls not bridged because the previous call ended on `length`
    temperature_splits: int = 0  # calls not bridged because they were sampled at another temperature
    dropped_long_prompt: int = 0
    truncated_rows: int = 0
    single_row_attempts: int = 0  # attempts whose every call landed in one row
    mismatches: list[PrefixMismatch] = field(default_factory=list)
    excluded: list[ExcludedRollout] = field(default_factory=list)  # rollouts left out (`merge_rollouts`)

    @property
    def mismatch_rate(self) -> float:
        """Prefix breaks per bridging opportunity (calls after an attempt's first)."""
        chances = self.bridges + len(self.mismatches)
        return len(self.mismatches) / chances if chances else 0.0

    def counts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}

    def add(self, other: MergeStats) -> None:
        for name, value in other.counts().items():
            setattr(self, name, getattr(self, name) + value)
        self.mismatches.extend(other.mismatches)
        self.excluded.extend(other.excluded)

    def to_dict(self) -> dict[str, float | int]:
        return {
            **self.counts(),
            "mismatches": len(self.mismatches),
            "mismatch_rate": self.mismatch_rate,
            "excluded_rollouts": len(self.excluded),
        }


def _llm_calls(spans: Sequence[Span]) -> list[Span]:
    calls = [s for s in spans if s.kind == SpanKind.llm]
    for s in calls:
        if s.prompt_token_ids is None or s.response_token_ids is None or s.response_logprobs is None:
            raise _invalid(s, "LLM span without prompt/response token ids or logprobs")
        if len(s.response_logprobs) != len(s.response_token_ids):
            raise _invalid(s, f"{len(s.response_logprobs)} logprobs for {len(s.response_token_ids)} tokens")
        ids = [*s.prompt_token_ids, *s.response_token_ids]
        if not s.prompt_token_ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise _invalid(s, "prompt empty or token ids not all non-negative integers")
        bad = [
            x for x in s.response_logprobs if not isinstance(x, int | float) or not x <= 0 or math.isinf(x)
        ]
        if bad:
            # a NaN, +inf or -inf (or positive) logprob is no probability the engine sampled at: as a
            # behaviour logprob it turns the importance weights, and then the loss and weights, into NaN
            raise _invalid(s, f"logprobs must be finite and <= 0, got {bad[:3]}")
        t = s.attributes.get("temperature")
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < math.inf:
            why = f"LLM span without a recorded sampling temperature (got {t!r})"
            raise _invalid(s, why, MissingTemperature)
    return sorted(calls, key=lambda s: s.sequence)


def dedupe_calls(calls: Sequence[Span]) -> list[Span]:
    """Keep the last call of each identical prompt (a client retry re-sends the same prompt), in order."""
    last = {tuple(c.prompt_token_ids or ()): i for i, c in enumerate(calls)}
    return [calls[i] for i in sorted(last.values())]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _new_row(call: Span) -> Row:
    assert call.prompt_token_ids is not None and call.response_token_ids is not None
    assert call.response_logprobs is not None
    return Row(
        rollout_id=call.rollout_id,
        attempt_id=call.attempt_id,
        prompt_ids=list(call.prompt_token_ids),
        response_ids=list(call.response_token_ids),
        loss_mask=[1] * len(call.response_token_ids),
        behaviour_logprobs=[float(x) for x in call.response_logprobs],
        temperature=float(call.attributes["temperature"]),
        span_ids=[call.span_id],
    )


def _extend_row(row: Row, call: Span) -> None:
    """Append `call` to `row`; its prompt is known to start with the row's tokens."""
    assert call.prompt_token_ids is not None and call.response_token_ids is not None
    assert call.response_logprobs is not None
    delta = call.prompt_token_ids[len(row) :]
    row.response_ids += list(delta) + list(call.response_token_ids)
    row.loss_mask += [0] * len(delta) + [1] * len(call.response_token_ids)
    row.behaviour_logprobs += [0.0] * len(delta) + [float(x) for x in call.response_logprobs]
    row.span_ids.append(call.span_id)


def _apply_limits(row: Row, config: TransitionConfig, stats: MergeStats) -> Row | None:
    if config.max_prompt_tokens is not None and len(row.prompt_ids) > config.max_prompt_tokens:
        stats.dropped_long_prompt += 1
        return None
    limit = config.max_response_tokens
    if limit is not None and len(row.response_ids) > limit:
        del row.response_ids[limit:], row.loss_mask[limit:], row.behaviour_logprobs[limit:]
        row.truncated = True
        stats.truncated_rows += 1
    return row


def merge_calls(
    spans: Sequence[Span], config: TransitionConfig = TransitionConfig()
) -> tuple[list[Row], MergeStats]:
    """One attempt's spans (any kinds, any order) -> its training rows and what happened on the way.
    Strict: an invalid span raises `TransitionError` naming it (`merge_rollouts` excludes its rollout)."""
    stats = MergeStats(attempts=1)
    calls = _llm_calls(spans)
    stats.calls = len(calls)
    kept = dedupe_calls(calls)
    stats.duplicates = len(calls) - len(kept)
    rows: list[Row] = []
    previous: Span | None = None
    for index, call in enumerate(kept):
        row = rows[-1] if rows else None
        if row is None or config.mode == "per_call":
            rows.append(_new_row(call))
        elif previous is not None and previous.finish_reason == "length":
            # The cut-off response has no end-of-turn token; bridging would teach the template's
            # closing tokens as if the model had emitted them.
            stats.length_splits += 1
            rows.append(_new_row(call))
        elif float(call.attributes["temperature"]) != row.temperature:
            # one row is scored at one temperature; the other call's logprobs are of another distribution
            stats.temperature_splits += 1
            rows.append(_new_row(call))
        else:
            assert call.prompt_token_ids is not None
            history = row.prompt_ids + row.response_ids
            at = _first_difference(history, call.prompt_token_ids)
            if at == len(history):
                _extend_row(row, call)
                stats.bridges += 1
            else:
                lo, hi = max(0, at - config.context), at + config.context + 1
                ids = (call.rollout_id, call.attempt_id, call.span_id, index, at)
                stats.mismatches.append(
                    PrefixMismatch(*ids, tuple(history[lo:hi]), tuple(call.prompt_token_ids[lo:hi]))
                )
                rows.append(_new_row(call))
        previous = call
    if len(rows) == 1 and config.mode == "merged":
        stats.single_row_attempts = 1
    limited = [r for r in (_apply_limits(r, config, stats) for r in rows) if r is not None]
    stats.rows = len(limited)
    return limited, stats


def build_rows(
    spans: Iterable[Span], config: TransitionConfig = TransitionConfig()
) -> tuple[list[Row], MergeStats]:
    """Spans of many attempts (as `Store.list_spans` returns them) -> rows of all, attempt by attempt."""
    by_attempt: dict[str, list[Span]] = {}
    for s in spans:
        by_attempt.setdefault(s.attempt_id, []).append(s)
    rows: list[Row] = []
    total = MergeStats()
    for attempt_spans in by_attempt.values():
        if not any(s.kind == SpanKind.llm for s in attempt_spans):
            continue
        attempt_rows, stats = merge_calls(attempt_spans, config)
        rows.extend(attempt_rows)
        total.add(stats)
    return rows, total


def merge_rollouts(
    rollouts: Iterable[tuple[str, Sequence[Span]]],
    config: TransitionConfig = TransitionConfig(),
    *,
    max_excluded_share: float,
    strict: bool = False,
) -> tuple[dict[str, list[Row]], MergeStats]:
    """(rollout id, its attempt's spans) pairs -> each kept rollout's rows, and the merge statistics.

    A rollout with an invalid span is left out whole (a part of its trajectory would be trained under the
    whole rollout's advantage) and listed in `MergeStats.excluded`. `strict` re-raises instead."""
    share = max_excluded_share
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        raise ValueError(f"max_excluded_share must be a number in [0, 1], got {share!r}")
    kept: dict[str, list[Row]] = {}
    total = MergeStats()
    considered = 0
    for rollout_id, spans in rollouts:
        considered += 1
        try:
            rows, stats = merge_calls(spans, config)
        except TransitionError as exc:
            if strict:
                raise
            total.excluded.append(ExcludedRollout(rollout_id, exc.span_id, exc.reason))
            continue
        kept[rollout_id] = rows
        total.add(stats)
    if total.excluded and (len(total.excluded) > share * considered or not kept):
        raise _too_many(total.excluded, considered, share)
    return kept, total
