"""The chat format: the ChatML template with tool calls, OpenAI message normalisation, tool-call parsing.

Format (every boundary is a special token, which is what makes rendering prefix-preserving):

    <|im_start|>system\\n{system}\\n# Tools\\n{tool json}\\n{tool json}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<tool_call>{"name": "f", "arguments": {...}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n{result}<|im_end|>\\n
    <|im_start|>assistant\\n                       <- generation prompt
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

from lightning_dagster.model_folder import ModelFolderError, check_model_folder

CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the EOS token: an assistant turn ends with it
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Order fixes the ids: 0, 1, 2 are special (skipped by decode), 3, 4 are kept in decoded text so that
# `parse_assistant` can see them.
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
MARKER_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE]

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


class InvalidMessages(ValueError):
    """The messages or tools given to `render` are not OpenAI-shaped."""


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> what the template expects: text content (parts joined), tool calls with
    `function.arguments` as given (a JSON string is rendered verbatim)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidMessages("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidMessages(f"message {i} must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidMessages(f"message {i}: only text content parts are supported")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise InvalidMessages(f"message {i}: content must be a string, a list of parts or null")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise InvalidMessages(f"message {i}: tool_calls must be a list")
            msg["tool_calls"] = []
            for call in calls:
                fn = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidMessages(f"message {i}: each tool call needs function.name")
                args = fn.get("arguments", {})
                if not isinstance(args, str | dict):
                    raise InvalidMessages(f"message {i}: tool call arguments must be a JSON string or object")
                msg["tool_calls"].append({"function": {"name": fn["name"], "arguments": args}})
        out.append(msg)
    return out


def parse_assistant(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Generated assistant text -> (content, OpenAI tool_calls). Each well-formed `<tool_call>{"name": str,
    "arguments": object}</tool_call>` becomes a tool call (`arguments` as the JSON string the template renders
    back); a malformed block stays in the content. Content is None when only whitespace is left."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _TOOL_CALL_RE.finditer(text):
        call = _parse_call(match.group(1))
        if call is None:
            continue  # malformed: left in place, copied with the surrounding text
        kept.append(text[pos : match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept)
    if calls and not content.strip():
        return None, calls
    return content, calls


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the OpenAI string form; accept it if it is JSON
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


class ChatCodec:
    """A checkpoint's text side without its weights: render, decode, parse tool calls, end-of-turn ids."""

    def __init__(self, model_dir: Path | str, tokenizer: Any = None, eos_token_ids: set[int] | None = None):
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.model_dir = Path(model_dir)
        if tokenizer is None:
            check_model_folder(self.model_dir, weights=False)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.model_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelFolderError(f"{self.model_dir}: the tokenizer has no chat template")
        if eos_token_ids is None:
            sources: list[Any] = [AutoConfig.from_pretrained(self.model_dir)]
            try:
                sources.insert(0, GenerationConfig.from_pretrained(self.model_dir))
            except OSError:  # a checkpoint without generation_config.json
                pass
            eos_token_ids = eos_ids(sources, self.tokenizer)
        self.eos_token_ids: set[int] = eos_token_ids

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """OpenAI-shaped messages (and tools) -> prompt ids via the checkpoint's chat template."""
        text = self.tokenizer.apply_chat_template(
            normalize_messages(messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Text -> ids with no BOS/EOS added (chat templates write their own special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Ids -> text without special tokens (tool-call markers are not special and stay)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    parse_assistant = staticmethod(parse_assistant)


def eos_ids(sources: list[Any], tokenizer: Any) -> set[int]:
    """End-of-turn ids: every `eos_token_id` of the generation config and model config, and the tokenizer's."""
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
