"""The conversation an LLM span records for replicas (`attempts.conversation`) survives the store's checks and
rebuilds the last call exactly, also when the sampled reply holds characters the store refuses raw (NUL)."""

from __future__ import annotations

import json
from array import array

from lightning_dagster.gateway.attempts import AttemptContext, conversation
from lightning_dagster.gateway.tokenin import LastCall
from lightning_dagster.store.connection import check_json
from lightning_dagster.types import AttemptState, RolloutKind


def _context(recorded: dict) -> AttemptContext:
    ctx = AttemptContext("r1", "a1", RolloutKind.train, None, None, AttemptState.running, 0.0, 1)
    ctx.last_ids, ctx.recorded = array("i", [1, 2, 3, 4]), recorded
    return ctx


def test_a_reply_with_a_nul_is_recorded_escaped_and_rebuilds_the_same_last_call():
    user = {"role": "user", "content": "2+2?"}
    reply = {"role": "assistant", "content": "4\x00\x07 done"}
    last = LastCall.of([user], reply, None, [1, 2], [3, 4])
    recorded = json.loads(json.dumps(conversation(last)))  # as stored and read back
    check_json("spans.attributes", {"conversation": recorded})  # raises InvalidInput on a raw NUL
    ctx = _context(recorded)
    ctx.resume([user, reply, {"role": "user", "content": "and 3+3?"}], None)
    assert ctx.last is not None
    assert ctx.last.raw_messages == [user, reply]
    assert ctx.last.messages == last.messages


def test_messages_whose_earlier_turns_differ_from_the_recorded_call_are_not_resumed():
    user = {"role": "user", "content": "2+2?"}
    reply = {"role": "assistant", "content": "4"}
    last = LastCall.of([user], reply, None, [1, 2], [3, 4])
    ctx = _context(json.loads(json.dumps(conversation(last))))
    ctx.resume([{"role": "user", "content": "2+3?"}, reply, {"role": "user", "content": "sure?"}], None)
    assert ctx.last is None
