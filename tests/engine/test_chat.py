"""The chat format: prefix-preserving rendering, tool-call round trips, the re-tokenization drift fixture."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dagster.engine import InvalidMessages, parse_assistant
from lightning_dagster.engine.build import CALCULATOR_TOOL
from lightning_dagster.model_folder import ModelFolderError


def _call(name: str, args: dict) -> dict:
    return {
        "id": "call_x",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


CONVERSATION = [
    {"role": "system", "content": "Use the calculator tool, then reply ANSWER: <number>."},
    {"role": "user", "content": "Ann has 12 pens and buys 7 more. How many pens now?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("calculator", {"expression": "12 + 7"})]},
    {"role": "tool", "tool_call_id": "call_x", "content": "19"},
    {
        "role": "assistant",
        "content": "Checking twice.",
        "tool_calls": [_call("calculator", {"expression": "7+12"})],
    },
    {"role": "tool", "tool_call_id": "call_x", "content": "19"},
    {"role": "assistant", "content": "ANSWER: 19"},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "doubled?"}]},
]


@pytest.mark.parametrize("tools", [None, [CALCULATOR_TOOL]])
def test_rendering_a_longer_conversation_only_appends_tokens(engine, tools):
    full = engine.render(CONVERSATION, tools, add_generation_prompt=True)
    for k in range(1, len(CONVERSATION) + 1):
        closed = engine.render(CONVERSATION[:k], tools, add_generation_prompt=False)
        assert full[: len(closed)] == closed, f"turn {k} is not a token prefix"
        if k < len(CONVERSATION) and CONVERSATION[k]["role"] == "assistant":
            # the generation prompt is a prefix of the conversation with the assistant's answer in it
            prompt = engine.render(CONVERSATION[:k], tools, add_generation_prompt=True)
            assert full[: len(prompt)] == prompt


def test_template_renders_tools_tool_calls_and_tool_results(engine):
    text = engine.decode(engine.render(CONVERSATION[:4], [CALCULATOR_TOOL], add_generation_prompt=True))
    assert text == (
        "system\nUse the calculator tool, then reply ANSWER: <number>.\n# Tools\n"
        + json.dumps(CALCULATOR_TOOL["function"])
        + "\nuser\nAnn has 12 pens and buys 7 more. How many pens now?\n"
        + 'assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 7"}}</tool_call>\n'
        + "tool\n19\nassistant\n"
    )
    ids = engine.render(CONVERSATION[:2])
    special = engine.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == special[0] and ids.count(special[1]) == 2 and ids[-1] != special[1]


def test_tool_calls_round_trip_through_render_and_parse(engine):
    calls = [_call("calculator", {"expression": "3 * (4 + 5)"}), _call("lookup", {"key": "ümlaut", "n": 2})]
    for content in (None, "Let me compute."):
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        prompt = engine.render(CONVERSATION[:2])
        turn = engine.render([*CONVERSATION[:2], message], add_generation_prompt=False)
        assert turn[: len(prompt)] == prompt
        # what the model would sample: the turn's tokens up to and including <|im_end|>
        sampled = turn[len(prompt) : -1]
        assert sampled[-1] in engine.eos_token_ids
        parsed_content, parsed_calls = engine.parse_assistant(engine.decode(sampled))
        assert parsed_content == content
        assert [c["function"]["name"] for c in parsed_calls] == ["calculator", "lookup"]
        for got, sent in zip(parsed_calls, calls, strict=True):
            assert got["id"].startswith("call_") and got["type"] == "function"
            assert json.loads(got["function"]["arguments"]) == json.loads(sent["function"]["arguments"])
        # and the parsed message renders back to the very same tokens
        again = engine.render(
            [*CONVERSATION[:2], {"role": "assistant", "content": parsed_content, "tool_calls": parsed_calls}],
            add_generation_prompt=False,
        )
        assert again == turn


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        'ok <tool_call>{"name": "f", "arguments": {}}',  # never closed (cut by max_tokens)
    ],
)
def test_malformed_tool_calls_stay_in_the_content(text):
    assert parse_assistant(text) == (text, [])


def test_well_formed_calls_are_taken_out_and_malformed_ones_kept():
    bad = "<tool_call>{oops}</tool_call>"
    content, calls = parse_assistant(
        f'a{bad}b<tool_call>{{"name": "f", "arguments": "{{\\"x\\": 1}}"}}</tool_call>'
    )
    assert content == f"a{bad}b"
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert parse_assistant("plain answer") == ("plain answer", [])


def test_render_rejects_messages_that_are_not_openai_shaped(engine):
    with pytest.raises(InvalidMessages):
        engine.render([])
    with pytest.raises(InvalidMessages):
        engine.render([{"content": "no role"}])
    with pytest.raises(InvalidMessages):
        engine.render([{"role": "user", "content": 5}])
    with pytest.raises(InvalidMessages):
        engine.render([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])


_piece = st.sampled_from(list('ab 7+{}"\n\t.:é€') + ["<tool_call>", "<|im_end|>", "  "])
_text = st.lists(_piece, max_size=10).map("".join)
_message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, _text),
    st.builds(lambda c: {"role": "tool", "content": c}, _text),
    st.builds(
        lambda c, args: {
            "role": "assistant",
            "content": c or None,
            "tool_calls": [_call("calculator", {"expression": a}) for a in args],
        },
        _text,
        st.lists(_text, max_size=2),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.one_of(st.none(), _text), messages=st.lists(_message, min_size=1, max_size=5))
def test_prefix_preservation_holds_for_arbitrary_text(engine, system, messages):
    """Any content (whitespace, unicode, even special-token text) keeps every earlier turn a token prefix."""
    convo = ([{"role": "system", "content": system}] if system is not None else []) + messages
    full = engine.render(convo, [CALCULATOR_TOOL], add_generation_prompt=False)
    for k in range(1, len(convo)):
        head = engine.render(
            convo[:k], [CALCULATOR_TOOL], add_generation_prompt=convo[k]["role"] == "assistant"
        )
        assert full[: len(head)] == head


def test_the_chat_codec_names_a_tokenizer_without_a_chat_template(model_dir, tmp_path):
    from lightning_dagster.engine.chat import ChatCodec

    copy = shutil.copytree(model_dir, tmp_path / "copy")
    (copy / "chat_template.jinja").unlink()
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelFolderError, match="the tokenizer has no chat template"):
        ChatCodec(copy)
