"""A checkpoint's non-weight files (tokenizer, chat template, configs) are pinned by `files_hash` as its
weights are by `weights_hash`: a file swapped after the receipt is refused at promotion and at download."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from lightning_dagster.registry import CheckpointFilesMismatch, WeightsMismatch
from lightning_dagster.registry.checkpoints import files_hash, files_manifest
from lightning_dagster.release import promotion
from lightning_dagster.release.errors import PromotionRefused
from tests.registry.helpers import approve, candidate_kwargs, passing_receipt


@pytest.fixture
def checkpoint(base_checkpoint, tmp_path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(base_checkpoint, out)
    return out


def test_files_hash_covers_every_non_weight_file_and_only_those(checkpoint, tmp_path):
    before = files_hash(checkpoint)
    assert before.startswith("sha256:")
    assert set(files_manifest(checkpoint)) == {
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    copy = shutil.copytree(checkpoint, tmp_path / "copy")
    assert files_hash(copy) == before  # content and relative paths, not where or when
    (checkpoint / "model.safetensors").write_bytes(b"other weights")  # weights are weights_hash's
    assert files_hash(checkpoint) == before
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        edited = shutil.copytree(copy, tmp_path / f"edit-{name}")
        (edited / name).write_text((edited / name).read_text() + " ")
        assert files_hash(edited) != before, name
    renamed = shutil.copytree(copy, tmp_path / "renamed")
    (renamed / "chat_template.jinja").rename(renamed / "chat_template.j2")
    assert files_hash(renamed) != before  # the path is hashed too
    nested = shutil.copytree(copy, tmp_path / "nested")
    (nested / "extra").mkdir()
    (nested / "extra" / "notes.txt").write_text("added")
    assert "extra/notes.txt" in files_manifest(nested) and files_hash(nested) != before


def test_symlinks_inside_hash_as_their_target_and_outside_are_refused(checkpoint, tmp_path):
    before = files_hash(checkpoint)
    (checkpoint / "templates").mkdir()
    shutil.move(checkpoint / "chat_template.jinja", checkpoint / "templates" / "chat.jinja")
    os.symlink("templates/chat.jinja", checkpoint / "chat_template.jinja")
    manifest = files_manifest(checkpoint)
    assert manifest["chat_template.jinja"] == manifest["templates/chat.jinja"]
    assert files_hash(checkpoint) != before  # templates/chat.jinja is a file of its own
    os.remove(checkpoint / "templates" / "chat.jinja")
    with pytest.raises(CheckpointFilesMismatch, match="chat_template.jinja points at no regular file"):
        files_hash(checkpoint)
    outside = tmp_path / "outside.jinja"
    outside.write_text("{{ messages }}")
    os.remove(checkpoint / "chat_template.jinja")
    os.symlink(outside, checkpoint / "chat_template.jinja")
    with pytest.raises(CheckpointFilesMismatch, match="points outside the checkpoint") as err:
        files_hash(checkpoint)
    assert err.value.changed == ["chat_template.jinja"]
    os.remove(checkpoint / "chat_template.jinja")
    shutil.rmtree(checkpoint / "templates")
    os.symlink(tmp_path, checkpoint / "linked-dir")
    with pytest.raises(CheckpointFilesMismatch, match="linked-dir links to a directory"):
        files_hash(checkpoint)


def _artifact(tracking, run_id: str, name: str) -> Path:
    (path,) = [
        p for p in Path(tracking.artifact_root).rglob(name) if run_id in p.parts and "checkpoint" in p.parts
    ]
    return path


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_file_swapped_after_the_receipt_is_refused_at_promotion(registry, variant, tracking, approver_keys):
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    tags = MlflowClient(tracking.uri, tracking.uri).get_model_version(registry.model_name, cand.version).tags
    assert tags["files_hash"] == cand.files_hash == files_hash(variant(1))
    assert registry.model_version(cand.version).files_manifest == files_manifest(variant(1))

    def pin_files(data):
        data["candidate"]["files_hash"] = cand.files_hash

    receipt = passing_receipt(registry, parent, cand, "rec-files", approver_keys, edit=pin_files)
    assert receipt.candidate.files_hash == cand.files_hash
    assert receipt.to_json_dict()["candidate"]["files_hash"] == cand.files_hash
    approve(registry, receipt, approver_keys, "alice")

    for name in ("tokenizer_config.json", "chat_template.jinja"):
        path = _artifact(tracking, cand.run_id, name)
        original = path.read_bytes()
        path.write_bytes(original.replace(b"}", b"} ", 1) if name.endswith(".json") else original + b"{# #}")
        with pytest.raises(PromotionRefused, match=name) as err:
            promotion.promote(registry, "rec-files", "alice", key=approver_keys["alice"])
        assert isinstance(err.value.__cause__, CheckpointFilesMismatch)
        assert err.value.__cause__.changed == [name]
        with pytest.raises(CheckpointFilesMismatch):  # a download for serving or the canary refuses too
            registry.download(cand.version)
        assert registry.current() == parent.version
        path.write_bytes(original)

    result = promotion.promote(
        registry, "rec-files", "alice", key=approver_keys["alice"]
    )  # the files as registered: promoted
    assert result.move.to_value == cand.version
    assert registry.history()[-1].note.count(cand.files_hash) == 1  # the move records what it approved


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_the_receipt_and_the_pointer_pin_the_files_hash_against_a_rewritten_tag(
    registry, variant, tracking, approver_keys
):
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    client = MlflowClient(tracking.uri, tracking.uri)

    def pin_files(data):
        data["candidate"]["files_hash"] = cand.files_hash

    approve(
        registry,
        passing_receipt(registry, parent, cand, "rec-tag", approver_keys, edit=pin_files),
        approver_keys,
        "alice",
    )
    client.delete_model_version_tag(registry.model_name, cand.version, "files_hash")
    with pytest.raises(PromotionRefused, match="the receipt names " + cand.files_hash):
        promotion.promote(registry, "rec-tag", "alice", key=approver_keys["alice"])
    client.set_model_version_tag(registry.model_name, cand.version, "files_hash", cand.files_hash)
    promotion.promote(registry, "rec-tag", "alice", key=approver_keys["alice"])

    # After approval, a files_hash tag rewritten to match swapped files is still not what was approved.
    client.set_model_version_tag(registry.model_name, cand.version, "files_hash", "sha256:" + "0" * 64)
    with pytest.raises(CheckpointFilesMismatch) as err:
        registry.resolve(download=False)
    assert isinstance(err.value, WeightsMismatch) and err.value.expected == cand.files_hash


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_tampered_cache_is_fetched_again(registry, variant):
    parent = registry.register_initial_parent(variant(0))
    cached = registry.download(parent.version)
    (cached / "tokenizer_config.json").write_text("{}")
    again = registry.download(parent.version)
    assert files_hash(again) == parent.files_hash
    assert (again / "tokenizer_config.json").read_bytes() == (
        variant(0) / "tokenizer_config.json"
    ).read_bytes()
