"""A registered version's checkpoint on local disk, verified against two hashes: `weights_hash` over the
tensors, and `files_hash` (sha256 over sorted relative paths and each file's sha256) over every other file
(tokenizer, chat template, configs change what a model says as surely as its weights). A symlink to a file
inside the checkpoint is hashed as that file; any other link is refused. The cache, keyed by weights hash,
is re-verified on every use: a cache can be tampered with too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from lightning_dagster.registry.errors import CheckpointFilesMismatch, RegistryError, WeightsMismatch
from lightning_dagster.registry.lineage import CandidateVersion

FILES_HASH_PREFIX = "sha256:"
# The per-file list is kept as a version tag when it fits (MLflow caps tag values), to name changed files.
MANIFEST_TAG_CHARS = 5000


def weights_hash(path: Path) -> str:
    # Imported here: the engine pulls in torch, which only hashing needs.
    from lightning_dagster.engine import checkpoint_hash

    return checkpoint_hash(Path(path))


def same_hash(a: str | None, b: str | None) -> bool:
    """Weights hashes compare without the `sha256:` prefix a receipt may carry (the engine writes hex)."""
    return bool(a) and bool(b) and a.removeprefix("sha256:") == b.removeprefix("sha256:")


def weight_files(root: Path) -> set[str]:
    """The files `engine.checkpoint_hash` reads (top-level `*.safetensors`, else top-level `*.bin`)."""
    files = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
    return {f.name for f in files}


def files_manifest(checkpoint_dir: Path | str, *, version: str = "?") -> dict[str, str]:
    root = Path(checkpoint_dir)
    real_root = root.resolve()
    skip = weight_files(root)
    manifest: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for name in sorted(dirnames):
            if (here / name).is_symlink():
                _refuse_link(root, here / name, "links to a directory", version)
        for name in filenames:
            path = here / name
            rel = path.relative_to(root).as_posix()
            if rel in skip:
                continue
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(real_root):
                    _refuse_link(root, path, f"points outside the checkpoint ({target})", version)
                if not target.is_file():
                    _refuse_link(root, path, "points at no regular file", version)
            manifest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(manifest.items()))


def _refuse_link(root: Path, path: Path, why: str, version: str) -> None:
    rel = path.relative_to(root).as_posix()
    raise CheckpointFilesMismatch(
        version, "a checkpoint without outside links", f"symlink {rel} {why}", [rel]
    )


def manifest_hash(manifest: dict[str, str]) -> str:
    """`files_hash` of a manifest: sha256 over its sorted `path NUL sha256 LF` lines."""
    digest = hashlib.sha256()
    for rel in sorted(manifest):
        digest.update(f"{rel}\0{manifest[rel]}\n".encode())
    return FILES_HASH_PREFIX + digest.hexdigest()


def files_hash(checkpoint_dir: Path | str) -> str:
    return manifest_hash(files_manifest(checkpoint_dir))


def manifest_tag(manifest: dict[str, str]) -> str | None:
    """The manifest as a compact JSON tag value, None when too long for a tag."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= MANIFEST_TAG_CHARS else None


def changed_files(registered: dict[str, str] | None, actual: dict[str, str]) -> list[str]:
    if not registered:
        return []
    return sorted(k for k in set(registered) | set(actual) if registered.get(k) != actual.get(k))


def verify_files(version: CandidateVersion, checkpoint_dir: Path) -> None:
    """`CheckpointFilesMismatch` unless the non-weight files hash to the version's `files_hash` (if any)."""
    if not version.files_hash:
        return
    actual = files_manifest(checkpoint_dir, version=version.version)
    digest = manifest_hash(actual)
    if digest != version.files_hash:
        raise CheckpointFilesMismatch(
            version.version, version.files_hash, digest, changed_files(version.files_manifest, actual)
        )


def _verified(version: CandidateVersion, checkpoint_dir: Path) -> bool:
    if weights_hash(checkpoint_dir) != version.weights_hash:
        return False
    try:
        verify_files(version, checkpoint_dir)
    except CheckpointFilesMismatch:
        return False
    return True


def cached_checkpoint(
    version: CandidateVersion, cache_dir: Path, fetch: Callable[[str, Path], None], *, fresh: bool = False
) -> Path:
    """The version's checkpoint under `cache_dir`, fetched unless it is cached and verifies."""
    expected = version.weights_hash
    if not expected:
        raise RegistryError(
            f"version {version.version} has no weights_hash tag; it was not registered by this registry"
        )
    target = cache_dir / expected.replace(":", "-")  # a directory name, not an identity
    if target.is_dir():
        if not _verified(version, target):
            shutil.rmtree(target, ignore_errors=True)
        elif not fresh:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        fetch(version.run_id, tmp)
        actual = weights_hash(tmp / "checkpoint")
        if actual != expected:
            raise WeightsMismatch(version.version, expected, actual)
        verify_files(version, tmp / "checkpoint")
        try:
            os.rename(tmp / "checkpoint", target)
        except OSError:  # another process put the same bytes there first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
