"""The one signed-message format: every kind of decision (approval, loop resume, rollback, roles pin) signs
and verifies the canonical bytes `signing.signed_message(purpose, fields)` builds, so a signature of one
kind never verifies as another, field order does not matter, any changed field fails, and signatures in the
formats each kind had before (its own purpose string and dict) verify no more."""

from __future__ import annotations

import base64
import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.canonical import canonical_json
from lightning_dagster.gate.receipt import Approval, parse_receipt
from lightning_dagster.release.approvals import approval_fields, approval_problem, evidence_hash
from lightning_dagster.release.errors import NotAuthorized
from lightning_dagster.release.pauses import ResumeRequest, resume_fields, resume_problem
from lightning_dagster.release.roles import parse_roles, pin_fields, pin_roles
from lightning_dagster.release.rollbacks import RollbackRequest, rollback_fields, rollback_problem
from lightning_dagster.release.signing import (
    APPROVAL,
    FORMAT,
    LOOP_RESUME,
    POINTER_MOVE,
    PURPOSES,
    RECEIPT_ATTESTATION,
    ROLES_PIN,
    ROLLBACK,
    VERSION,
    ActorKey,
    public_key_line,
    sign,
    signed_message,
    verify,
)
from lightning_dagster.settings import GateSettings
from lightning_dagster.store import Store
from tests.gate.conftest import raw

KEY = Ed25519PrivateKey.generate()
PUBLIC = public_key_line(KEY)
ROLES = ["release-owner", "default-approver", "roles-admin"]
ACTORS = {"alice": ActorKey(frozenset(ROLES), PUBLIC)}


def raw_signature(message: bytes, key: Ed25519PrivateKey = KEY) -> str:
    """A signature over exactly `message`, made without the release's helpers."""
    return base64.b64encode(key.sign(message)).decode()


def envelope(purpose: str, fields: dict[str, Any], version: int = VERSION) -> bytes:
    """The format's bytes for any purpose, fields and version, bypassing the table `signed_message` checks."""
    return canonical_json({"format": FORMAT, "version": version, "purpose": purpose, "fields": fields})


@dataclass
class Kind:
    purpose: str
    fields: dict[str, Any]
    accepts: Callable[[str], bool]  # the kind's own verifier, given a signature over `fields`
    old_message: bytes  # what this kind signed before the one format


def _approval() -> Kind:
    receipt = parse_receipt(raw("a"))
    approval = Approval(
        actor="alice", role="release-owner", step="canary", at=1000.0, evidence_hash=evidence_hash(receipt)
    )
    fields = approval_fields(receipt.receipt_id, approval)

    def accepts(signature: str) -> bool:
        signed = approval.model_copy(update={"signature": signature})
        return approval_problem(receipt, signed, ACTORS, {approval.evidence_hash}) is None

    return Kind(
        APPROVAL, fields, accepts, canonical_json({"purpose": "lightning-dagster approval v1", **fields})
    )


def _resume() -> Kind:
    request = ResumeRequest(
        actor="alice", role="default-approver", reason="ok", at=100.0, pause_hash="sha256:p"
    )
    fields = resume_fields(request)

    def accepts(signature: str) -> bool:
        signed = request.model_copy(update={"signature": signature})
        return (
            resume_problem(signed, "sha256:p", ACTORS, ["default-approver"], paused_at=50.0, now=200.0)
            is None
        )

    return Kind(
        LOOP_RESUME,
        fields,
        accepts,
        canonical_json({"purpose": "lightning-dagster loop resume v1", **fields}),
    )


def _rollback() -> Kind:
    request = RollbackRequest(
        target_version="1", from_version="2", from_seq=2, actor="alice", role="default-approver",
        reason="regressed", at=1100.0,
    )  # fmt: skip
    head = SimpleNamespace(to_value="2", seq=2, moved_at=1000.0)
    fields = rollback_fields("approved-default", request)

    def accepts(signature: str) -> bool:
        signed = request.model_copy(update={"signature": signature})
        return (
            rollback_problem(signed, "approved-default", head, ACTORS, ["default-approver"], now=1200.0)
            is None
        )

    return Kind(
        ROLLBACK, fields, accepts, canonical_json({"purpose": "lightning-dagster rollback v1", **fields})
    )


def _attestation() -> Kind:
    from lightning_dagster.gate import attestation

    att = attestation.Attestation(version=2, previous_hash="sha256:v1", at=1300.0, signature="-")
    fields = attestation.signed_fields("res-cand-a", "sha256:v2", att)

    def accepts(signature: str) -> bool:
        signed = att.model_copy(update={"signature": signature})
        return attestation.problem(PUBLIC, "res-cand-a", "sha256:v2", signed) is None

    # a new kind: nothing signed it before the one format; a bare message naming it must not verify either
    return Kind(
        RECEIPT_ATTESTATION, fields, accepts, canonical_json({"purpose": RECEIPT_ATTESTATION, **fields})
    )


def _roles_pin(tmp_path: Path) -> Kind:
    def roles(*names: str):
        return parse_roles({"actors": {n: {"roles": ROLES, "key": PUBLIC} for n in names}}, "test")

    first, second = roles("alice"), roles("alice", "carol")
    fields = pin_fields(first.digest, second.digest, pin_seq=1)

    gate = GateSettings(roles_admin_key=PUBLIC)  # the configured roles-admin key

    def accepts(signature: str) -> bool:
        with Store(f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}") as store:  # a fresh pin per attempt
            pin_roles(
                store, first, gate, signature=sign(KEY, ROLES_PIN, pin_fields(None, first.digest, pin_seq=0))
            )
            try:
                pin_roles(store, second, gate, signature=signature)
            except NotAuthorized:
                return False
            return True

    old = {"purpose": "lightning-dagster roles pin v2", **fields}
    return Kind(ROLES_PIN, fields, accepts, canonical_json(old))


def _pointer_move() -> Kind:
    """A promotion of approved-default from move 1, checked by the chain's one verifier."""
    import json

    from lightning_dagster.release import chain
    from lightning_dagster.store.records import PointerMove

    roles = parse_roles({"actors": {"alice": {"roles": ROLES, "key": PUBLIC}}}, "test")
    first = PointerMove(name="approved-default", from_value=None, to_value="1", actor="pipeline", receipt_id=None,
                        note="{}", moved_at=1000.0, seq=1)  # fmt: skip
    note = chain.move_note("sha256:w", None, kind=chain.PROMOTION, role="default-approver", at=1100.0)
    fields = chain.signed_fields("approved-default", 2, "1", "2", "alice", None, note)

    def accepts(signature: str) -> bool:
        move = PointerMove(name="approved-default", from_value="1", to_value="2", actor="alice", receipt_id=None,
                           note=json.dumps({**note, "signature": signature}), moved_at=1100.0, seq=2)  # fmt: skip
        return chain.check_move(None, move, [first], [roles], 0, GateSettings())[0] is None

    return Kind(POINTER_MOVE, fields, accepts, canonical_json({"purpose": "pointer move", **fields}))


@pytest.fixture
def kinds(tmp_path) -> dict[str, Kind]:
    made = (_approval(), _resume(), _rollback(), _roles_pin(tmp_path), _pointer_move(), _attestation())
    return {k.purpose: k for k in made}


def test_the_table_names_every_kind_and_each_kind_builds_exactly_its_fields(kinds):
    expected = {APPROVAL, LOOP_RESUME, ROLLBACK, ROLES_PIN, POINTER_MOVE, RECEIPT_ATTESTATION}
    assert set(PURPOSES) == set(kinds) == expected
    for purpose, kind in kinds.items():
        assert set(kind.fields) == PURPOSES[purpose], purpose


def test_each_kind_verifies_a_signature_over_the_one_format_and_nothing_else(kinds):
    other_key = Ed25519PrivateKey.generate()
    for purpose, kind in kinds.items():
        message = signed_message(purpose, kind.fields)
        assert message == envelope(purpose, kind.fields)
        assert kind.accepts(raw_signature(message)), purpose
        assert kind.accepts(sign(KEY, purpose, kind.fields)), purpose
        refused = {
            "old format": raw_signature(kind.old_message),
            "other version": raw_signature(envelope(purpose, kind.fields, VERSION + 1)),
            "other key": raw_signature(message, other_key),
            "fields alone": raw_signature(canonical_json(kind.fields)),
        }
        for what, signature in refused.items():
            assert not kind.accepts(signature), (purpose, what)


def test_a_signature_of_one_kind_never_verifies_as_another(kinds):
    for (p1, k1), (p2, k2) in itertools.permutations(kinds.items(), 2):
        assert not verify(PUBLIC, p2, k2.fields, sign(KEY, p1, k1.fields)), (p1, p2)
        # Even over the very fields the other kind binds, the purpose alone keeps them apart.
        assert not k2.accepts(raw_signature(envelope(p1, k2.fields))), (p1, p2)


def test_field_order_does_not_matter(kinds):
    for purpose, kind in kinds.items():
        reordered = dict(reversed(kind.fields.items()))
        assert list(reordered) != list(kind.fields)
        assert signed_message(purpose, reordered) == signed_message(purpose, kind.fields)
        assert verify(PUBLIC, purpose, reordered, sign(KEY, purpose, kind.fields)), purpose


def _changed(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return "changed"
    if isinstance(value, int | float):
        return value + 1
    return value + "x"


def test_any_changed_field_fails(kinds):
    for purpose, kind in kinds.items():
        signature = sign(KEY, purpose, kind.fields)
        assert verify(PUBLIC, purpose, kind.fields, signature)
        for name, value in kind.fields.items():
            assert not verify(PUBLIC, purpose, {**kind.fields, name: _changed(value)}, signature), (
                purpose,
                name,
            )
        # A time of the same value as another type (1000 and 1000.0) is other bytes too.
        if isinstance(kind.fields.get("at"), float):
            as_int = {**kind.fields, "at": int(kind.fields["at"])}
            assert not verify(PUBLIC, purpose, as_int, signature), purpose


def test_a_message_with_an_unknown_purpose_or_other_fields_is_refused_before_signing(kinds):
    fields = kinds[ROLLBACK].fields
    with pytest.raises(ValueError, match="unknown signed-message purpose"):
        signed_message("lightning-dagster rollback v1", fields)
    with pytest.raises(ValueError, match=r"missing \['reason'\]"):
        sign(KEY, ROLLBACK, {k: v for k, v in fields.items() if k != "reason"})
    with pytest.raises(ValueError, match=r"extra \['loop'\]"):
        verify(PUBLIC, ROLLBACK, {**fields, "loop": "x"}, sign(KEY, ROLLBACK, fields))
    with pytest.raises(ValueError, match="signs exactly"):
        signed_message(APPROVAL, fields)  # another kind's fields


def test_the_signing_side_signs_the_one_format(tmp_path, kinds):
    """`sign_approval` and `loop_history.sign_resume` produce signatures over `signed_message`'s bytes."""
    from lightning_dagster.pipeline import loop_history
    from lightning_dagster.release.receipts import sign_approval
    from lightning_dagster.release.signing import generate_keypair, load_private_key

    key_file = generate_keypair("alice", tmp_path / "keys").private_path
    public = load_private_key(key_file).public_key()
    receipt = parse_receipt(raw("a"))
    approval = sign_approval(
        receipt, actor="alice", role="release-owner", key=key_file, step="canary", at=5.0
    )
    fields = approval_fields(receipt.receipt_id, approval)
    public.verify(base64.b64decode(approval.signature), signed_message(APPROVAL, fields))  # raises if not

    with Store(f"sqlite:///{tmp_path / 'loop.db'}") as store:
        paused = loop_history.tick(store, "rcpt-1", ["protected set regressed"], []).recorded
        request = loop_history.sign_resume(
            store, actor="alice", key=key_file, reason="accepted", at=paused.decision.at
        )
    assert request.pause_hash == paused.hash
    public.verify(base64.b64decode(request.signature), signed_message(LOOP_RESUME, resume_fields(request)))
