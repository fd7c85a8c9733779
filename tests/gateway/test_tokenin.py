"""Token-in builds a prompt on the previous call's exact ids only where the template agrees with that splice;
anywhere else it declines (the caller renders afresh and counts a fallback), never splicing wrong ids."""

from __future__ import annotations

from lightning_dagster.gateway.tokenin import (
    LastCall,
    TokenInStats,
    closing_tokens,
    continue_prompt,
    continues,
)

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def byte_template(*, tool_turn_end: str = "E", mark_last: bool = False):
    """A template over byte ids: `<role>content` then an end-of-turn byte. `tool_turn_end` closes an
    assistant turn that calls a tool (Llama 3.1 ends those with <|eom_id|> instead of <|eot_id|>);
    `mark_last` writes `!` after the last message's content, so no longer conversation extends a shorter one."""

    def render(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        text = ""
        for k, m in enumerate(messages):
            text += f"<{m['role']}>{m.get('content') or ''}"
            text += "!" if mark_last and k == len(messages) - 1 else ""
            text += tool_turn_end if m.get("tool_calls") else "E"
        return list((text + ("<assistant>" if add_generation_prompt else "")).encode())

    return render


def first_call(render, assistant: dict) -> tuple[list[dict], LastCall]:
    messages = [{"role": "user", "content": "hi"}]
    prompt = render(messages, None, True)
    sampled = [900, 901, ord("E")]  # ids no text re-encodes to, then the end of turn
    return messages, LastCall.of(messages, assistant, None, prompt, sampled)


def test_a_continued_conversation_is_spliced_onto_the_sampled_ids():
    render = byte_template()
    closing = closing_tokens(render)
    assert closing == [ord("E")]
    messages, last = first_call(render, {"role": "assistant", "content": "yo"})
    follow = [*messages, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]
    ids = continue_prompt(render, closing, last, follow, None)
    assert ids == [*last.ids, *b"<user>okE<assistant>"]  # the sampled EOS is not doubled


def test_an_assistant_turn_closed_otherwise_than_the_probe_is_not_spliced():
    render = byte_template(tool_turn_end="M")
    assistant = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
    messages, last = first_call(render, assistant)
    follow = [*messages, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    assert continues(last, follow, None)
    assert continue_prompt(render, closing_tokens(render), last, follow, None) is None
    # the same conversation under a template closing every turn alike is spliced
    plain = byte_template()
    assert continue_prompt(plain, closing_tokens(plain), last, follow, None) is not None


def test_a_template_that_rewrites_earlier_turns_gets_no_splice_at_all():
    render = byte_template(mark_last=True)
    assert closing_tokens(render) is None
    messages, last = first_call(render, {"role": "assistant", "content": "yo"})
    follow = [*messages, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]
    assert continues(last, follow, None)
    assert continue_prompt(render, closing_tokens(render), last, follow, None) is None
    # with a probe that happens to pass, the per-call check still refuses
    assert continue_prompt(render, [ord("E")], last, follow, None) is None


def test_an_edited_history_or_other_tools_does_not_continue():
    render = byte_template()
    messages, last = first_call(render, {"role": "assistant", "content": "yo"})
    edited = [*messages, {"role": "assistant", "content": "changed"}, {"role": "user", "content": "ok"}]
    same = [*messages, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}]
    assert not continues(last, edited, None)
    assert not continues(last, same, [{"type": "function", "function": {"name": "g"}}])
    assert not continues(last, same[:2], None) and not continues(None, same, None)


def test_stats_count_fallbacks_apart_from_token_in():
    stats = TokenInStats()
    stats.count(False, False)
    stats.count(True, True)
    stats.count(True, False, True)
    assert stats.as_dict() == {
        "calls": 3,
        "continuations": 2,
        "token_in": 1,
        "fallbacks": 1,
        "token_in_share": 0.5,
    }
