"""The pipeline's own key. Its private half attests every receipt version the pipeline writes and signs the
bootstrap move of `approved-default`; it lives in a 0600 file the deployment configures
(`gate.pipeline_key_path`, `$LD_PIPELINE_KEY`) outside the learner's write surface (the models folder and
MLflow's artifacts), and harnesses never get its path (their environment is scrubbed). Readers verify against
the public half from the configuration (`gate.pipeline_public_key`, else derived from the private file),
never against anything the store holds.
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
    """The pipeline's private key, None when the deployment configures none; `KeyFileError` for a key file
    inside the learner's write surface, readable by others, or not an Ed25519 PEM."""
    if not gate.pipeline_key_path:
        return None
    path = Path(gate.pipeline_key_path).resolve()
    for surface in (paths.models_dir(), paths.mlflow_artifact_root()):
        if path.is_relative_to(surface.resolve()):
            raise KeyFileError(f"pipeline key {path} lies inside the learner's write surface {surface}")
    return load_private_key(path)


def public_key(gate: GateSettings) -> str | None:
    """The pipeline's public key line (`ed25519:...`) readers verify against, None when none is configured;
    `KeyFileError` when the configured public key is malformed or is not the configured private key's."""
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
    """The pipeline keys a deployment's receipt ledger attests and verifies with (`gate.ledger.use_keys`)."""
    return PipelineKeys(signing=signing_key(gate), public=public_key(gate))
