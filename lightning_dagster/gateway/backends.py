"""Where completions come from: the embedded engine (token-in, exact ids) here, or upstream OpenAI-compatible
servers (`gateway.upstreams`). Both return a `Completion`, so the two record the same span fields.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.tokenin import LastCall, closing_tokens, continue_prompt

if TYPE_CHECKING:
    import torch

    from lightning_dagster.engine import BatchingEngine


@dataclass
class Completion:
    """One sampled choice with the exact ids that produced it."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None
    content: str | None  # text (chat: without tool-call markup)
    finish_reason: str
    model: str
    tool_calls: list[dict] = field(default_factory=list)
    token_texts: list[str] | None = None  # per response token, for OpenAI `logprobs`
    token_source: str = "rendered"  # reused | rendered | upstream | ids | text
    upstream: str | None = None  # the upstream server that produced it (upstream mode)


@dataclass
class CallSampling:
    """The sampling of one call, as applied (the request's, with the rollout's seed and decided sampling)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False


class Backend(abc.ABC):
    """A source of completions; `route` (the rollout id) keeps a rollout's calls on one server."""

    resource_id: str | None = None
    kind: str = "backend"
    token_in: bool = False  # whether `chat` builds prompts from the previous call (needs `LastCall`)
    # whether `load_weights(state, resource_id)` swaps the weights served (the embedded engine, vLLM); an
    # upstream serves what its server loaded
    loads_weights: bool = False
    model_dir: Path | None = None  # the checkpoint served at start (a backend that loads weights)
    codec: Any = None  # the served model's chat codec (`engine.chat.ChatCodec`): renders token-in prompts
    _closing: list[int] | None = None  # `tokenin.closing_tokens` of the codec's template

    def verify(self, weights: str | None) -> None:  # noqa: B027 - only engines that can drift check
        """Raise GatewayError unless the engine still serves the weights with hash `weights`."""

    @property
    @abc.abstractmethod
    def model(self) -> str: ...

    def serves(self, name: str) -> bool:
        """Whether a request naming this model is served (the gateway's aliases aside)."""
        return name == self.model

    @abc.abstractmethod
    async def chat(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        tool_choice: Any,
        sampling: CallSampling,
        previous: LastCall | None,
        body: dict,
        *,
        route: str | None = None,
    ) -> Completion: ...

    @abc.abstractmethod
    async def complete(
        self, prompt: str | list[int], sampling: CallSampling, body: dict, *, route: str | None = None
    ) -> Completion: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        pass

    def _render(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool
    ) -> list[int]:
        return self.codec.render(messages, tools, add_generation_prompt=add_generation_prompt)

    def _chat_prompt(
        self, messages: list[dict], tools: list[dict] | None, previous: LastCall | None
    ) -> tuple[list[int], str]:
        """A chat call's prompt ids and their source: `reused` (token-in), else `rendered` afresh."""
        ids = continue_prompt(self._render, self._closing, previous, messages, tools)
        if ids is not None:
            return ids, "reused"
        try:
            return self._render(messages, tools, True), "rendered"
        except Exception as exc:  # jinja / template errors are the request's fault
            raise GatewayError(400, f"messages could not be rendered: {exc}", param="messages") from exc


class EngineBackend(Backend):
    """The embedded model. Prompts come from token-in when the conversation continues the last call."""

    kind = "engine"
    token_in = True
    loads_weights = True

    def __init__(self, engine: BatchingEngine, resource_id: str | None = None):
        self.batching = engine
        self.engine = self.codec = engine.engine
        self.model_dir = engine.engine.model_dir
        self.resource_id = resource_id
        self._closing = closing_tokens(self._render)

    @property
    def model(self) -> str:
        return self.resource_id or self.engine.model_dir.name

    def load_weights(self, state: dict[str, torch.Tensor], resource_id: str | None) -> None:
        """Blocking: swaps all weights at once; on any error the old weights keep serving."""
        from lightning_dagster.engine.engine import StateDictMismatch

        try:
            self.engine.load_weights(state)
        except StateDictMismatch as exc:
            raise GatewayError(400, f"the weights do not fit the served model: {exc}", param="path") from exc
        self.resource_id = resource_id

    async def _generate(self, prompt_ids: list[int], sampling: CallSampling) -> Any:
        from lightning_dagster.engine import EngineClosed, EngineError, SamplingParams

        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop),
            seed=sampling.seed,
            **({"max_tokens": sampling.max_tokens} if sampling.max_tokens is not None else {}),
        )
        try:
            return await asyncio.wrap_future(self.batching.submit(prompt_ids, params))
        except EngineError as exc:
            raise GatewayError(400, str(exc)) from exc
        except EngineClosed as exc:
            raise GatewayError(503, f"the engine is not serving: {exc}") from exc

    def _completion(self, gen: Any, sampling: CallSampling, source: str, **fields: Any) -> Completion:
        """The `Completion` of a `Generation`; `fields` override its text and finish reason."""
        texts = [self.engine.decode([i]) for i in gen.token_ids] if sampling.logprobs else None
        return Completion(
            prompt_ids=list(gen.prompt_token_ids),
            response_ids=list(gen.token_ids),
            logprobs=list(gen.logprobs),
            model=self.model,
            token_texts=texts,
            token_source=source,
            **{"content": gen.text, "finish_reason": gen.finish_reason, **fields},
        )

    async def chat(self, messages, tools, tool_choice, sampling, previous, body, *, route=None) -> Completion:
        prompt_ids, source = await anyio.to_thread.run_sync(self._chat_prompt, messages, tools, previous)
        gen = await self._generate(prompt_ids, sampling)
        content, calls = (gen.text, []) if tool_choice == "none" else self.engine.parse_assistant(gen.text)
        finish = "tool_calls" if calls else gen.finish_reason
        return self._completion(
            gen, sampling, source, content=content, finish_reason=finish, tool_calls=calls
        )

    async def complete(self, prompt, sampling, body, *, route=None) -> Completion:
        ids, source = (
            (self.engine.encode(prompt), "text") if isinstance(prompt, str) else (list(prompt), "ids")
        )
        return self._completion(await self._generate(ids, sampling), sampling, source)
