"""The tokenizer fingerprint a transitions file records: the same for the same tokenizer however it was
saved or loaded, another for one changed merge, one added special token or another chat template, and the
transitions file refuses a trainer whose tokenizer differs by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from lightning_dagster.engine import tokenizer_fingerprint, tokenizer_fingerprint_of
from lightning_dagster.pipeline.transitions_file import TokenizerMismatch, load_transitions, write_transitions
from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from tests.training.conftest import random_rows, trainer_config


@pytest.fixture()
def copy_of(base_model_dir, tmp_path):
    def copy(name: str):
        return shutil.copytree(base_model_dir, tmp_path / name)

    return copy


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _written(tmp_path, tokenizer: str):
    rows = random_rows(5, {"a": 1, "b": 1})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 0.0)], "grpo")
    return write_transitions(tmp_path / "t.jsonl.gz", rows, adv, tokenizer=tokenizer)


def test_the_same_tokenizer_has_one_fingerprint(base_model_dir, tmp_path):
    fp = tokenizer_fingerprint_of(base_model_dir)
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64
    assert tokenizer_fingerprint(_tokenizer(base_model_dir)) == fp
    _tokenizer(base_model_dir).save_pretrained(tmp_path / "resaved")  # written again by transformers
    assert tokenizer_fingerprint_of(tmp_path / "resaved") == fp
    # another process (another hash seed) computes the same
    code = "import sys; from lightning_dagster.engine import tokenizer_fingerprint_of as f; print(f(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(base_model_dir)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == fp
    path = _written(tmp_path, fp)
    assert load_transitions(path.as_uri(), tokenizer=tokenizer_fingerprint_of(tmp_path / "resaved")).rows


def test_a_trained_checkpoint_keeps_its_parents_fingerprint(base_model_dir, tmp_path):
    from lightning_dagster.training.trainer import Trainer

    out = Trainer(base_model_dir, trainer_config()).save(tmp_path / "candidate")
    assert tokenizer_fingerprint_of(out) == tokenizer_fingerprint_of(base_model_dir)


def _swap_last_merges(model_dir):
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    merges[-1], merges[-2] = merges[-2], merges[-1]
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))


def _add_special_token(model_dir):
    tok = _tokenizer(model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool_result|>"]})
    tok.save_pretrained(model_dir)


def _other_chat_template(model_dir):
    tok = _tokenizer(model_dir)
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ", 1)
    tok.save_pretrained(model_dir)


@pytest.mark.parametrize("change", [_swap_last_merges, _add_special_token, _other_chat_template])
def test_a_changed_tokenizer_is_refused_by_name(change, base_model_dir, copy_of, tmp_path):
    built_with = tokenizer_fingerprint_of(base_model_dir)
    other = copy_of("other")
    change(other)
    trainer_has = tokenizer_fingerprint_of(other)
    assert trainer_has != built_with
    path = _written(tmp_path, built_with)
    with pytest.raises(TokenizerMismatch) as caught:
        load_transitions(path.as_uri(), tokenizer=trainer_has)
    assert built_with in str(caught.value) and trainer_has in str(caught.value)
