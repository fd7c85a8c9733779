"""Build the embedded base model from scratch (no download): a byte-level BPE trained on the caller's corpus,
a tiny Qwen2-, Llama- or GPT-2-shaped causal LM instantiated from config with its own special tokens and chat
template, all saved in Hugging Face format."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lightning_dagster.engine.chat import IM_END, MARKER_TOKENS, PAD_TOKEN, SPECIAL_TOKENS
from lightning_dagster.engine.vllm_worker.ld_vllm_worker import tensors_digest_update
from lightning_dagster.settings import UsageError


class EmptyCorpus(ValueError):
    """`build_base_model` was given no texts (or one string) to train its tokenizer on."""


class UnknownArchitecture(ValueError, UsageError):
    """`build_base_model` was asked for a shape it cannot build, or a size setting the shapes do not have."""


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


@dataclass(frozen=True)
class Architecture:
    """What differs between the shapes `build_base_model` makes. `special_tokens` take ids 0, 1, ... in
    order (the tool-call markers follow); `eos[0]` is the tokenizer's EOS and every `eos` token ends a turn
    in the config and generation config."""

    config_class: str  # transformers class names
    model_class: str
    special_tokens: tuple[str, ...]
    eos: tuple[str, ...]
    pad: str
    bos: str | None
    template: str  # a file next to this module
    # transformers name of each MODEL_SHAPE setting (None: the shape has no such setting)
    names: tuple[tuple[str, str | None], ...] = ()


ARCHITECTURES = {
    "qwen2": Architecture(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        tuple(SPECIAL_TOKENS),
        (IM_END,),
        PAD_TOKEN,
        None,
        "chat_template.jinja",
    ),
    # Llama 3's format: header tokens around the role, <|eot_id|> ends a turn, <|end_of_text|> a text
    "llama": Architecture(
        "LlamaConfig",
        "LlamaForCausalLM",
        (
            "<|finetune_right_pad_id|>",
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        ("<|eot_id|>", "<|end_of_text|>"),
        "<|finetune_right_pad_id|>",
        "<|begin_of_text|>",
        "llama_chat_template.jinja",
    ),
    # GPT-2's one special token ends every turn and pads (as GPT-2 pads with EOS); role tokens open turns
    "gpt2": Architecture(
        "GPT2Config",
        "GPT2LMHeadModel",
        ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"),
        ("<|endoftext|>",),
        "<|endoftext|>",
        None,
        "gpt2_chat_template.jinja",
        names=(("intermediate_size", "n_inner"), ("num_key_value_heads", None)),
    ),
}

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
    """Text that every rendered conversation repeats (role headers, tool schemas, the tool-call prefix),
    weighted so BPE merges it: a corpus lists a tool schema once, but every prompt carries it."""
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


def train_tokenizer(corpus: Iterable[str], arch: Architecture, max_length: int):
    """Byte-level BPE with the shape's special tokens and chat template, as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[*arch.special_tokens, *MARKER_TOKENS],
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
    named = {arch.eos[0], arch.pad, arch.bos}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=arch.eos[0],
        pad_token=arch.pad,
        **({"bos_token": arch.bos} if arch.bos else {}),
        additional_special_tokens=[t for t in arch.special_tokens if t not in named],
        padding_side="left",
        clean_up_tokenization_spaces=False,  # any cleanup would change text, hence re-encoded ids
        model_max_length=max_length,
    )
    fast.chat_template = (Path(__file__).parent / arch.template).read_text()
    return fast


# The text the example agents exchange (`harnesses.corpus.training_corpus()`, written here by
# scripts/make_example_data.py): the embedded default model's tokenizer is trained on it.
CORPUS_FILE = Path(__file__).with_name("corpus.json")


def default_corpus() -> list[str]:
    """The corpus the embedded default model is built on (`CORPUS_FILE`)."""
    return json.loads(CORPUS_FILE.read_text())


def build_base_model(
    out_dir: Path | str,
    *,
    corpus: Sequence[str],
    seed: int = 0,
    architecture: str = "qwen2",
    shape: Mapping[str, Any] | None = None,
) -> Path:
    """Train the tokenizer on `corpus`, instantiate the tiny causal LM of `architecture` ("qwen2", "llama" or
    "gpt2"; seeded init) sized by `MODEL_SHAPE` updated with `shape`, save both to `out_dir`. Deterministic:
    the same call gives the same `checkpoint_hash`."""
    if isinstance(corpus, str) or not corpus:
        raise EmptyCorpus("the tokenizer needs a non-empty sequence of texts to train on")
    if architecture not in ARCHITECTURES:
        raise UnknownArchitecture(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[architecture]
    unknown = sorted(set(shape or {}) - set(MODEL_SHAPE))
    if unknown:
        raise UnknownArchitecture(f"unknown shape settings {unknown}; known: {sorted(MODEL_SHAPE)}")
    sizes = {**MODEL_SHAPE, **(shape or {})}
    import transformers
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    tokenizer = train_tokenizer(corpus, arch, sizes["max_position_embeddings"])
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in arch.eos]
    eos: int | list[int] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad_id = tokenizer.convert_tokens_to_ids(arch.pad)
    bos_id = tokenizer.convert_tokens_to_ids(arch.bos) if arch.bos else None
    names = dict(arch.names)
    config = getattr(transformers, arch.config_class)(
        vocab_size=len(tokenizer),
        bos_token_id=bos_id,
        eos_token_id=eos,
        pad_token_id=pad_id,
        **{names.get(k, k): v for k, v in sizes.items() if names.get(k, k)},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, arch.model_class)(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=pad_id, **({"bos_token_id": bos_id} if bos_id is not None else {})
    )
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
    if files:
        tensors = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = handle.get_tensor(name)
        return tensors_hash(tensors)
    digest = hashlib.sha256()
    bins = sorted(model_dir.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(f"no weight files (*.safetensors, *.bin) in {model_dir}")
    for f in bins:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """`checkpoint_hash` of tensors in memory (what a checkpoint holding exactly these tensors hashes to)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensors_digest_update(digest, name, tensors[name])  # the vLLM worker hashes what it loads alike
    return digest.hexdigest()


def save_weights(state_dict: Mapping[str, torch.Tensor], path: Path | str) -> None:
    """A state dict as one safetensors file; a tied tensor (shared storage, which safetensors refuses) is
    copied for each later name (`Engine.load_weights` accepts tied names given twice)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(tensors, str(path))
