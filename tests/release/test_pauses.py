"""Pause and resume as decisions: a stop condition pauses naming its condition and receipt; the pause holds
until an authorized actor's signed resume or a newer receipt that clears it; a resume signs one pause."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.release.pauses import (
    LoopDecision,
    ResumeRequest,
    actor_resume,
    next_decision,
    resume_fields,
    resume_problem,
    resume_roles_of,
)
from lightning_dagster.release.signing import LOOP_RESUME, PUBLIC_KEY_PREFIX, ActorKey, sign

KEY = Ed25519PrivateKey.generate()
PUBLIC = (
    PUBLIC_KEY_PREFIX
    + base64.b64encode(
        KEY.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    ).decode()
)
ACTORS = {
    "bob": ActorKey(frozenset({"default-approver"}), PUBLIC),
    "eve": ActorKey(frozenset({"viewer"}), PUBLIC),
}
PROTECTED = ["protected set regressed: family arith: 1 regressed (tolerance 0): p-1"]


def signed(
    actor: str = "bob", role: str = "default-approver", pause: str = "sha256:p1", **kw
) -> ResumeRequest:
    fields = {
        "actor": actor,
        "role": role,
        "reason": "regression accepted by owner",
        "at": 10.0,
        "pause_hash": pause,
    }
    fields.update(kw)
    request = ResumeRequest(**fields)
    return request.model_copy(update={"signature": sign(KEY, LOOP_RESUME, resume_fields(request))})


def test_a_stop_condition_pauses_naming_the_condition_and_the_receipt():
    pause = next_decision([], "rcpt-1", PROTECTED, [], now=1.0)
    assert pause is not None and (pause.action, pause.by) == ("pause", "gate")
    assert pause.conditions == PROTECTED and pause.receipt_id == "rcpt-1"
    assert next_decision([], "rcpt-1", [], [], now=1.0) is None  # nothing holds: no decision


def test_a_pause_names_the_roles_that_may_lift_it_else_the_default_approver():
    pause = next_decision([], "rcpt-1", PROTECTED, [], now=1.0, resume_roles=["loop-owner"])
    assert pause.resume_roles == ["loop-owner"] and resume_roles_of(pause) == ["loop-owner"]
    older = LoopDecision.model_validate({"action": "pause", "by": "sensor", "at": 1.0})  # named none
    assert resume_roles_of(older) == ["default-approver"]
    assert resume_roles_of(pause.model_copy(update={"resume_roles": []})) == []  # nobody, not the default


def test_a_paused_loop_stays_paused_on_the_same_receipt_or_a_newer_one_that_still_stops():
    pause = next_decision([], "rcpt-1", PROTECTED, [], now=1.0)
    assert next_decision([pause], "rcpt-1", PROTECTED, [], now=2.0) is None
    assert next_decision([pause], "rcpt-2", PROTECTED, [], now=2.0) is None
    assert next_decision([pause], "rcpt-1", [], [], now=2.0) is None  # same receipt: not a clearing one


def test_a_newer_receipt_meeting_no_condition_resumes_by_itself():
    pause = next_decision([], "rcpt-1", PROTECTED, [], now=1.0)
    cleared = next_decision([pause], "rcpt-2", [], [], now=2.0)
    assert cleared is not None and (cleared.action, cleared.by, cleared.receipt_id) == (
        "resume",
        "receipt",
        "rcpt-2",
    )
    assert next_decision([pause], "rcpt-2", [], ["parent unavailable: x"], now=2.0) is None


def test_an_actors_resume_accepts_that_receipt_but_not_a_newer_one_nor_live_conditions():
    pause = next_decision([], "rcpt-1", PROTECTED, [], now=1.0)
    resumed = actor_resume(signed(), pause)
    assert (resumed.action, resumed.by, resumed.receipt_id, resumed.actor) == (
        "resume",
        "actor",
        "rcpt-1",
        "bob",
    )
    assert next_decision([pause, resumed], "rcpt-1", PROTECTED, [], now=3.0) is None
    again = next_decision([pause, resumed], "rcpt-2", PROTECTED, [], now=3.0)
    assert again is not None and again.action == "pause" and again.receipt_id == "rcpt-2"
    live = next_decision([pause, resumed], "rcpt-1", PROTECTED, ["parent unavailable: gone"], now=3.0)
    assert live is not None and live.conditions == ["parent unavailable: gone"]


def test_an_authorized_signed_resume_of_the_pause_in_force_verifies():
    assert resume_problem(signed(), "sha256:p1", ACTORS, ["default-approver"]) is None


@pytest.mark.parametrize(
    "request_, pause, fragment",
    [
        (signed().model_copy(update={"signature": ""}), "sha256:p1", "not signed"),
        (signed(actor="eve", role="viewer"), "sha256:p1", "may not resume"),
        (signed(actor="eve"), "sha256:p1", "does not hold role"),
        (signed(actor="mallory"), "sha256:p1", "not among the deployment's approvers"),
        (signed(pause="sha256:p0"), "sha256:p1", "not the pause in force"),
        (signed().model_copy(update={"reason": "edited after signing"}), "sha256:p1", "does not verify"),
        (signed(), None, "not paused"),
    ],
)
def test_an_unsigned_unauthorized_or_replayed_resume_is_refused(request_, pause, fragment):
    problem = resume_problem(request_, pause, ACTORS, ["default-approver"])
    assert problem is not None and fragment in problem


def test_a_resume_needs_a_reason():
    with pytest.raises(ValueError, match="reason"):
        ResumeRequest(actor="bob", role="default-approver", reason="", at=1.0, pause_hash="sha256:p1")


def test_decisions_refuse_unknown_fields():
    with pytest.raises(ValueError, match="extra"):
        LoopDecision.model_validate({"action": "pause", "by": "sensor", "at": 1.0, "why": "x"})


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("reason", "   ", "blank"),
        ("reason", "ok\x1b[2J", "control characters"),
        ("reason", "line one\nline two", "control characters"),
        ("reason", "x" * 1025, "at most 1024"),
        ("actor", " ", "blank"),
        ("role", "default-approver\x00", "control characters"),
        ("at", 0.0, "greater than 0"),
    ],
)
def test_a_resume_with_a_blank_oversized_or_control_character_field_is_refused(field, value, fragment):
    fields = {"actor": "bob", "role": "default-approver", "reason": "ok", "at": 1.0, "pause_hash": "h"}
    with pytest.raises(ValueError, match=field) as err:
        ResumeRequest(**{**fields, field: value})
    assert fragment in str(err.value)


def test_a_resume_dated_ahead_of_the_clock_or_before_its_pause_is_refused():
    kw = {"paused_at": 1000.0, "now": 2000.0}
    assert resume_problem(signed(at=1500.0), "sha256:p1", ACTORS, ["default-approver"], **kw) is None
    ahead = resume_problem(signed(at=1e20), "sha256:p1", ACTORS, ["default-approver"], **kw)
    assert ahead is not None and "ahead of the clock" in ahead
    before = resume_problem(signed(at=10.0), "sha256:p1", ACTORS, ["default-approver"], **kw)
    assert before is not None and "before the pause it lifts" in before
    # within the clock skew either way: a signer's clock need not be the sensor's
    skewed = [signed(at=1000.0 - 299), signed(at=2000.0 + 299)]
    assert all(resume_problem(r, "sha256:p1", ACTORS, ["default-approver"], **kw) is None for r in skewed)
