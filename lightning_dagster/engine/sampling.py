"""What a request asks the engine for (`SamplingParams`), what it gets back (`Generation`), and the one
sampling step every row goes through: inverse-CDF draws with the exact logprob of each sampled token."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch


class EngineError(ValueError):
    """A request the engine cannot serve (bad sampling parameters, bad or too long prompt)."""


@dataclass
class SamplingParams:
    """temperature 0 means greedy; its reported logprobs are then under T=1 (the model's own distribution),
    since a point mass would report 0 for every token."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature < math.inf:
            raise EngineError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise EngineError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise EngineError("stop must be a list of non-empty strings")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise EngineError(f"seed must be an integer or None, got {self.seed!r}")


@dataclass
class Generation:
    """`token_ids` include the final EOS token when the model ended its turn (it was sampled and has a
    logprob); `text` excludes special tokens and is cut before a matched stop string, as OpenAI does, while
    `token_ids` keep every sampled token up to the one that completed the stop string."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]


def sample(
    logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (inverse-CDF, one uniform from the row's generator) and its sampled-from logprob."""
    greedy = temps == 0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if bool((top_ps < 1).any()):
        logp = torch.log_softmax(logp.masked_fill(_outside_top_p(scaled, top_ps), float("-inf")), dim=-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
    cdf = logp.double().exp().cumsum(-1)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    tokens = tokens.clamp(max=logits.shape[-1] - 1)
    # float rounding can land u at the very top of the CDF, on a token outside the kept set
    bad = torch.isinf(logp.gather(1, tokens[:, None]).squeeze(1))
    tokens = torch.where(greedy | bad, logp.argmax(-1), tokens)
    if bool(greedy.any()):
        logp = torch.where(greedy[:, None], torch.log_softmax(logits, dim=-1), logp)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _outside_top_p(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Each row's tokens outside its smallest set of most likely tokens whose mass reaches top_p. Decided in
    float64: a row's logits differ in their last bits across batch shapes, and float32 rounding would move a
    token near the boundary in or out of the set, making logprobs depend on batch mates."""
    probs = torch.softmax(scaled.double(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop_sorted = mass_before >= top_ps.double()[:, None]
    return torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
