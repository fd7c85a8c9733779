"""A scripted policy: weight surgery on the tiny model so that greedy decoding after `<|im_start|>assistant\n`
emits a chosen token id sequence (any spelling, e.g. one that does not survive decode/encode), then EOS.

Attention and all MLPs but layer 0's are zeroed, so the next token depends only on the last one; layer 0's
MLP is a lookup table (one neuron per transition) that writes the next token's embedding direction into the
residual stream; embeddings are tied, so that direction's logit wins by ~10 nats.
"""

from __future__ import annotations

import torch


def spell(engine, text: str, *, avoid: set[int]) -> list[int]:
    """Token ids decoding to `text`, all distinct and outside `avoid` (depth-first, longest pieces first)."""
    pieces: dict[str, list[int]] = {}
    for i in range(engine.vocab_size):
        if i not in avoid:
            s = engine.decode([i])
            if s and "\ufffd" not in s:
                pieces.setdefault(s, []).append(i)
    order = sorted(pieces, key=len, reverse=True)

    def dfs(pos: int, used: set[int]) -> list[int] | None:
        if pos == len(text):
            return []
        for s in order:
            if text.startswith(s, pos):
                for i in pieces[s]:
                    if i not in used:
                        rest = dfs(pos + len(s), used | {i})
                        if rest is not None:
                            return [i, *rest]
        return None

    ids = dfs(0, set())
    if ids is None:
        raise ValueError(f"no spelling of {text!r} with distinct tokens")
    return ids


def script_weights(engine, start: int, script: list[int], eos: int) -> dict[str, torch.Tensor]:
    """A state dict for `engine.model` whose greedy continuation after token `start` is `script` + [eos]."""
    chain = [start, *script, eos]
    if len(set(chain)) != len(chain):
        raise ValueError("the script's tokens must be distinct and differ from start and eos")
    sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
    emb = sd["model.embed_tokens.weight"]
    d = emb.shape[1]
    if len(chain) > d:
        raise ValueError(f"script longer than the hidden size {d}")
    emb[:, : len(chain)] = 0.0  # other tokens stay orthogonal to the script's directions
    for k, tok in enumerate(chain):
        emb[tok] = 0.0
        emb[tok, k] = 1.0
    if "lm_head.weight" in sd:  # tied: a separate clone would overwrite the embedding on load
        sd["lm_head.weight"] = emb
    for name, value in sd.items():
        if (
            name.endswith(("o_proj.weight", "down_proj.weight"))
            or "layernorm" in name
            or name == "model.norm.weight"
        ):
            value.copy_(torch.ones_like(value) if "norm" in name else torch.zeros_like(value))
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    down = sd["model.layers.0.mlp.down_proj.weight"]
    gate.zero_()
    up.zero_()
    g = 1.0
    for k in range(len(chain) - 1):  # neuron k fires on token chain[k] and writes chain[k+1]'s direction
        gate[k, k] = g
        up[k, k] = g
        act = torch.nn.functional.silu(torch.tensor(g * d**0.5)) * g * d**0.5
        down[k + 1, k] = 20.0 / act
    return sd
