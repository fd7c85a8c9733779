"""Build the embedded base model from scratch (no download): a byte-level BPE trained on the caller's corpus,
a tiny Qwen2-shaped causal LM instantiated from config, both saved in Hugging Face format."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lightning_dagster.engine.chat import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    MARKER_TOKENS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
)


class EmptyCorpus(ValueError):
    """`build_base_model` was given no texts (or one string) to train its tokenizer on."""


VOCAB_SIZE = 768
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)

# A calculator tool in the OpenAI shape: its schema line is always among the rendered fragments.
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def _rendered_fragments(corpus: list[str]) -> list[str]:
    """Text that every rendered conversation repeats (role headers, the tools header, each tool's schema
    line, the tool-call prefix), weighted like one copy per conversation so BPE merges it: a corpus lists a
    tool schema once, but every prompt carries it."""
    tools = [CALCULATOR_TOOL]
    for text in corpus:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, list) and all(isinstance(t, dict) and "function" in t for t in value):
            tools += value
    fragments = [f"{role}\n" for role in ("system", "user", "assistant", "tool")] + ["\n# Tools"]
    for tool in tools:
        fn = tool["function"]
        fragments.append("\n" + json.dumps(fn, ensure_ascii=False))
        fragments.append('{"name": ' + json.dumps(fn["name"]) + ', "arguments": ')
    return fragments * max(1, len(corpus) // 20)


def train_tokenizer(corpus: Iterable[str], *, vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE with the chat special tokens, wrapped as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + MARKER_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(corpus)
    tok.train_from_iterator(texts + _rendered_fragments(texts), trainer)
    # The trainer marks every added token special; the tool-call markers must survive
    # decode(skip_special_tokens=True) so the parser sees them (as in Qwen's tokenizer).
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        if added["content"] in MARKER_TOKENS:
            added["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,  # any cleanup would change text, hence re-encoded ids
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_base_model(out_dir: Path | str, *, corpus: Sequence[str], seed: int = 0) -> Path:
    """Train the tokenizer on `corpus` (the text the model will see: the caller's, e.g. the harness
    registry's `training_corpus()`), instantiate the tiny Qwen2 causal LM (seeded init), save both to `out_dir`.

    Deterministic for a seed and corpus: the same call gives the same `checkpoint_hash`.
    """
    if isinstance(corpus, str) or not corpus:
        raise EmptyCorpus("the tokenizer needs a non-empty sequence of texts to train on")
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **MODEL_SHAPE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def checkpoint_hash(model_dir: Path | str) -> str:
    """sha256 over the weights (tensor names, dtypes, shapes and bytes in name order), so it is the same for
    the same weights however they were saved or sharded. Falls back to raw bytes for `.bin` checkpoints."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    digest = hashlib.sha256()
    if files:
        tensors = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = handle.get_tensor(name)
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    bins = sorted(model_dir.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(f"no weight files (*.safetensors, *.bin) in {model_dir}")
    for f in bins:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()
