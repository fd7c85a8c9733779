"""The embedded policy model: build a tiny HF causal LM from scratch (no download), render chats with tool
calls through its template, and sample batches with the exact logprob of every token."""

from lightning_dagster.engine.batch import NonFiniteLogits
from lightning_dagster.engine.batching import BatchingEngine, EngineClosed
from lightning_dagster.engine.build import build_base_model, checkpoint_hash
from lightning_dagster.engine.chat import CHAT_TEMPLATE, InvalidMessages, parse_assistant
from lightning_dagster.engine.engine import Engine, StateDictMismatch
from lightning_dagster.engine.sampling import EngineError, Generation, SamplingParams
from lightning_dagster.engine.tokenizer_hash import tokenizer_fingerprint, tokenizer_fingerprint_of

__all__ = [
    "CHAT_TEMPLATE", "BatchingEngine", "Engine", "EngineClosed", "EngineError", "Generation",
    "InvalidMessages", "NonFiniteLogits", "SamplingParams", "StateDictMismatch", "build_base_model",
    "checkpoint_hash", "parse_assistant", "tokenizer_fingerprint", "tokenizer_fingerprint_of",
]  # fmt: skip
