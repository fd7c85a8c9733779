"""The pipeline signs every receipt version it writes (`signing.RECEIPT_ATTESTATION`: receipt id, version
number, ledger hash over body and link, the hash it links to, the time). The ledger keeps each attestation
beside its version (`ATTESTATIONS`); a receipt file carries its version's as a top-level `attestation`, left
out of every hash. Verification recomputes the ledger hash from the receipt as parsed: a re-serialization
keeps its attestation; an edit of any field, another key, or another receipt's or version's signature does
not verify. Pure: the keys come from the deployment's configuration (`release.pipeline_key`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_dagster.gate.errors import from_validation_error
from lightning_dagster.release.signing import RECEIPT_ATTESTATION, sign, verify

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ATTESTATIONS = "receipt-attestations"  # store collection: doc id = receipt id, one body per attested version
FILE_KEY = "attestation"  # where a receipt file carries its version's attestation


class Attestation(BaseModel):
    """The pipeline's signature over one receipt version (the receipt id and ledger hash are recomputed)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    version: int = Field(ge=1)
    previous_hash: str | None
    at: float
    signature: str = Field(min_length=1)


@dataclass(frozen=True)
class PipelineKeys:
    """`signing` attests what is written, `public` verifies what is read (None: neither is done)."""

    signing: Ed25519PrivateKey | None = None
    public: str | None = None


NO_KEYS = PipelineKeys()


def signed_fields(receipt_id: str, content_hash: str, att: Attestation) -> dict[str, Any]:
    return {"receipt_id": receipt_id, "content_hash": content_hash, **att.model_dump(exclude={"signature"})}


def attest(
    key: Ed25519PrivateKey,
    receipt_id: str,
    version: int,
    content_hash: str,
    previous_hash: str | None,
    at: float | None = None,
) -> Attestation:
    unsigned = Attestation(
        version=version, previous_hash=previous_hash, at=time.time() if at is None else at, signature="-"
    )
    signature = sign(key, RECEIPT_ATTESTATION, signed_fields(receipt_id, content_hash, unsigned))
    return unsigned.model_copy(update={"signature": signature})


def problem(public_key: str, receipt_id: str, content_hash: str, att: Attestation | None) -> str | None:
    """Why `att` is not the pipeline's attestation of this receipt version (None: it is)."""
    if att is None:
        return "not attested: it carries no pipeline signature"
    fields = signed_fields(receipt_id, content_hash, att)
    if not verify(public_key, RECEIPT_ATTESTATION, fields, att.signature):
        return (
            f"attestation of version {att.version} does not verify with the pipeline key {public_key}: "
            "the receipt was changed after the pipeline signed it, or another key signed it"
        )
    return None


def parse(data: Any, where: str = FILE_KEY) -> Attestation:
    try:
        return Attestation.model_validate(data)
    except ValidationError as err:
        raise from_validation_error("receipt", err, where) from None


def split_file(data: Any) -> tuple[Any, Attestation | None]:
    """A receipt file's JSON: the receipt, and the attestation it carries (None: none)."""
    if not isinstance(data, dict) or FILE_KEY not in data:
        return data, None
    rest = {k: v for k, v in data.items() if k != FILE_KEY}
    return rest, parse(data[FILE_KEY])


def with_attestation(body: dict[str, Any], att: Attestation | None) -> dict[str, Any]:
    return body if att is None else {**body, FILE_KEY: att.model_dump(mode="json")}
