"""Building the base model: deterministic, loadable by plain transformers, any causal LM directory works."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lightning_dagster.cli import main
from lightning_dagster.engine import Engine, SamplingParams, build_base_model, checkpoint_hash
from lightning_dagster.engine.build import EmptyCorpus
from lightning_dagster.harnesses.corpus import training_corpus


def test_build_is_deterministic_for_a_seed_and_corpus(tmp_path):
    corpus = training_corpus(n_per_split=20, seed=3)
    a = build_base_model(tmp_path / "a", corpus=corpus, seed=1)
    b = build_base_model(tmp_path / "b", corpus=corpus, seed=1)
    c = build_base_model(tmp_path / "c", corpus=corpus, seed=2)
    assert checkpoint_hash(a) == checkpoint_hash(b) != checkpoint_hash(c)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert (a / "chat_template.jinja").is_file()
    other = build_base_model(tmp_path / "d", corpus=training_corpus(n_per_split=20, seed=4), seed=1)
    assert (other / "tokenizer.json").read_text() != (a / "tokenizer.json").read_text()


def test_build_without_a_corpus_is_a_named_error(tmp_path):
    for corpus in ([], "one string is not a corpus"):
        with pytest.raises(EmptyCorpus):
            build_base_model(tmp_path / "m", corpus=corpus)


def test_base_model_shape_and_special_tokens(engine):
    config = engine.model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 4, 128)
    assert 0.9e6 < sum(p.numel() for p in engine.model.parameters()) < 1.3e6
    tok = engine.tokenizer
    assert len(tok) == engine.vocab_size == 768
    ids = tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    )
    assert ids == [0, 1, 2, 3, 4]
    assert engine.eos_token_ids == {2} and engine.pad_token_id == 0
    # markers survive decode (the parser needs them); the turn tokens do not
    assert engine.decode([1, 3, 4, 2, 0]) == "<tool_call></tool_call>"


def test_save_and_load_reproduce_logits_exactly_and_keep_the_hash(engine, model_dir, tmp_path):
    again = tmp_path / "again"
    engine.model.save_pretrained(again)
    engine.tokenizer.save_pretrained(again)
    assert checkpoint_hash(again) == checkpoint_hash(model_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32).eval()
    ids = torch.tensor([engine.render([{"role": "user", "content": "Add 67 to bob."}])])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, engine.model(ids).logits)
    assert AutoTokenizer.from_pretrained(again)(["x 49"]).input_ids == engine.tokenizer(["x 49"]).input_ids


def test_checkpoint_hash_changes_with_the_weights(engine, model_dir, tmp_path):
    changed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        changed.model.norm.weight[0] += 1e-3
    changed.save_pretrained(tmp_path / "changed")
    assert checkpoint_hash(tmp_path / "changed") != checkpoint_hash(model_dir)


def test_any_causal_lm_directory_works_llama_shaped(engine, tmp_path):
    """The engine does not assume Qwen2: a Llama-shaped model with the same tokenizer samples exact logprobs."""
    config = LlamaConfig(
        vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    engine.tokenizer.save_pretrained(tmp_path / "llama")
    llama = Engine(tmp_path / "llama")
    prompts = [
        llama.render([{"role": "user", "content": t}]) for t in ("Hi", "Add 67 to bob, then reply DONE.")
    ]
    gens = llama.generate(prompts, SamplingParams(temperature=0.7, max_tokens=10, seed=1))
    for prompt, gen in zip(prompts, gens, strict=True):
        with torch.no_grad():
            logits = llama.model(torch.tensor([prompt + gen.token_ids])).logits[0]
        logp = torch.log_softmax(logits.float() / 0.7, -1)[len(prompt) - 1 : -1]
        expected = logp.gather(1, torch.tensor(gen.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)


def test_cli_info_prints_special_token_ids(model_dir, capsys):
    assert main(["engine", "info", str(model_dir)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["special_tokens"] == {"<|im_end|>": 2, "<|endoftext|>": 0, "<|im_start|>": 1}
    assert info["tool_call_markers"] == {"<tool_call>": 3, "</tool_call>": 4}
    assert info["checkpoint_hash"] == checkpoint_hash(model_dir)
    assert main(["engine", "info", str(model_dir / "missing")]) == 2


def test_cli_build_reproduces_the_default_base_model(model_dir, tmp_path, capsys):
    """`engine build` with the default (harness) corpus and seed gives the very same model and tokenizer."""
    assert main(["engine", "build", "--out", str(tmp_path / "cli"), "--seed", "0"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checkpoint_hash"] == checkpoint_hash(model_dir)
    assert (tmp_path / "cli" / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
