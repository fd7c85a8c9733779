"""A registered version's checkpoint on local disk, its bytes verified against the registered weights hash.

The cache is keyed by weights hash and re-verified on every use: a cache can be tampered with too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from lightning_dagster.registry.errors import RegistryError, WeightsMismatch
from lightning_dagster.registry.lineage import CandidateVersion


def weights_hash(path: Path) -> str:
    # Imported here: the engine pulls in torch, which only hashing needs.
    from lightning_dagster.engine import checkpoint_hash

    return checkpoint_hash(Path(path))


def cached_checkpoint(
    version: CandidateVersion, cache_dir: Path, fetch: Callable[[str, Path], None], *, fresh: bool = False
) -> Path:
    """The version's checkpoint under `cache_dir`, fetched with `fetch(run_id, into)` when the cache lacks
    it or holds other bytes (with `fresh`, always: what the registry serves to others is verified, not
    only this host's copy); a download whose bytes do not match raises `WeightsMismatch`."""
    expected = version.weights_hash
    if not expected:
        raise RegistryError(
            f"version {version.version} has no weights_hash tag; it was not registered by this registry"
        )
    target = cache_dir / expected.replace(":", "-")  # a directory name, not an identity
    if target.is_dir():
        if weights_hash(target) != expected:
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
        try:
            os.rename(tmp / "checkpoint", target)
        except OSError:  # another process put the same bytes there first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
