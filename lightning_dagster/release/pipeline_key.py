"""The pipeline's own key: its private half attests every receipt version the pipeline writes and signs the
bootstrap move; a 0600 file the deployment configures (`gate.pipeline_key_path`, $LD_PIPELINE_KEY) outside
the learner's write surface, whose path harnesses never get. Readers verify against the configured public
half (`gate.pipeline_public_key`, else derived from the private file), never anything the store holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dagster import paths
from lightning_dagster.gate.attestation import PipelineKeys
from lightning_dagster.release.errors import KeyFileError
from lightning_dagster.release.signing import load_private_key, parse_public_key, public_key_line

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from lightning_dagster.settings import GateSettings


def signing_key(gate: GateSettings) -> Ed25519PrivateKey | None:
    """The private key (None: none configured); `KeyFileError` for one in the learner's write surface."""
    if not gate.pipeline_key_path:
        return None
    path = Path(gate.pipeline_key_path).resolve()
    for surface in (paths.models_dir(), paths.mlflow_artifact_root()):
        if path.is_relative_to(surface.resolve()):
            raise KeyFileError(f"pipeline key {path} lies inside the learner's write surface {surface}")
    return load_private_key(path)


def public_key(gate: GateSettings) -> str | None:
    """The public key line (None: none configured); `KeyFileError` for one malformed or not the private's."""
    configured = gate.pipeline_public_key.strip()
    if configured:
        try:
            parse_public_key(configured)
        except ValueError as exc:
            raise KeyFileError(f"gate.pipeline_public_key: {exc}") from None
    private = signing_key(gate)
    derived = None if private is None else public_key_line(private)
    if configured and derived and configured != derived:
        raise KeyFileError(
            f"gate.pipeline_public_key {configured} is not the public half of {gate.pipeline_key_path} ({derived})"
        )
    return configured or derived


def keys(gate: GateSettings) -> PipelineKeys:
    return PipelineKeys(signing=signing_key(gate), public=public_key(gate))
