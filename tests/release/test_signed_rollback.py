"""Rollback is an authorized actor's signed decision, as promotion and resume are: refused (a named
`RollbackRefused`, one CLI line, a one-line `dg.Failure` of the `rollback` job) without a signature, with
a forged one or one by another key, by an actor without an allowed role, or over another target, pointer
value or time; a valid one moves the pointer once and the history records the verified actor."""

from __future__ import annotations

import base64
import json
import os
from types import SimpleNamespace

import pytest

from lightning_dagster.release import promotion, rollbacks
from lightning_dagster.release.errors import NotAuthorized, RollbackRefused
from lightning_dagster.release.rollbacks import (
    RollbackRequest,
    rollback_fields,
    rollback_problem,
)
from lightning_dagster.release.signing import ROLLBACK, ActorKey, load_private_key, public_key_line, sign
from tests.registry.helpers import approve, bootstrap, passing_receipt, signed_rollback

# ---------------------------------------------------------------- the rule, without MLflow


@pytest.fixture
def keys(approver_keys):
    return {a: load_private_key(approver_keys[a]) for a in ("alice", "bob", "mallory")}


@pytest.fixture
def actors(keys):
    return {
        "alice": ActorKey(frozenset({"default-approver"}), public_key_line(keys["alice"])),
        "bob": ActorKey(frozenset({"ml-lead"}), public_key_line(keys["bob"])),
    }


HEAD = SimpleNamespace(to_value="2", seq=2, moved_at=1000.0)
ROLES = ("default-approver",)


def _request(key, pointer="approved-default", **kw) -> RollbackRequest:
    fields = {
        "target_version": "1",
        "from_version": "2",
        "from_seq": 2,
        "actor": "alice",
        "role": "default-approver",
        "reason": "regression in production",
        "at": 1100.0,
        **kw,
    }
    request = RollbackRequest(**fields)
    return request.model_copy(update={"signature": sign(key, ROLLBACK, rollback_fields(pointer, request))})


def _problem(request, pointer="approved-default", head=HEAD, actors=None, now=1200.0):
    return rollback_problem(request, pointer, head, actors, ROLES, now=now)


def test_a_rollback_signed_by_a_default_approver_over_this_move_verifies(keys, actors):
    assert _problem(_request(keys["alice"]), actors=actors) is None


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda k: _request(k["alice"]).model_copy(update={"signature": ""}), "not signed"),
        (lambda k: _request(k["mallory"]), "does not verify with alice's key"),  # forged
        (lambda k: _request(k["bob"]), "does not verify with alice's key"),  # another actor's key
        (
            lambda k: _request(k["alice"]).model_copy(
                update={"signature": base64.b64encode(b"x" * 64).decode()}
            ),
            "does not verify",
        ),
        (
            lambda k: _request(k["alice"], target_version="7").model_copy(update={"target_version": "1"}),
            "does not verify",
        ),
        (lambda k: _request(k["alice"]).model_copy(update={"reason": "edited"}), "does not verify"),
        (lambda k: _request(k["alice"]).model_copy(update={"at": 1101.0}), "does not verify"),
        (lambda k: _request(k["alice"], pointer="other-model/approved-default"), "does not verify"),
        (lambda k: _request(k["bob"], actor="bob"), "does not hold role 'default-approver'"),
        (
            lambda k: _request(k["bob"], actor="bob", role="ml-lead"),
            "needs one of the roles ['default-approver']",
        ),
        (lambda k: _request(k["mallory"], actor="mallory"), "not among the deployment's approvers"),
        (
            lambda k: _request(k["alice"], from_version="3", from_seq=3),
            "approved-default is version 2 since move 2",
        ),
        (lambda k: _request(k["alice"], from_seq=1), "signs a rollback from version 2 (move 1)"),
        (lambda k: _request(k["alice"], at=1e12), "ahead of the clock"),
        (lambda k: _request(k["alice"], at=10.0), "before the move it undoes"),
    ],
    ids=[
        "unsigned",
        "forged",
        "wrong-key",
        "garbage",
        "other-target",
        "edited-reason",
        "edited-time",
        "other-pointer",
        "actor-without-role",
        "role-not-allowed",
        "unknown-actor",
        "other-value",
        "replayed-after-a-move",
        "future",
        "before-the-move",
    ],
)
def test_a_rollback_that_is_not_this_authorized_decision_is_named(keys, actors, make, fragment):
    problem = _problem(make(keys), actors=actors)
    assert problem is not None and fragment in problem and "\n" not in problem


# ---------------------------------------------------------------- the registry, the CLI and the job


@pytest.fixture
def promoted(registry, variant, tracking, approver_keys):
    parent, (cand,) = bootstrap(registry, variant)
    approve(
        registry,
        passing_receipt(registry, parent, cand, "rec-signed-rb", approver_keys),
        approver_keys,
        "alice",
    )
    promotion.promote(registry, "rec-signed-rb", "alice", key=approver_keys["alice"])
    return parent, cand


def _moves(registry):
    return [(m.from_value, m.to_value, m.actor) for m in registry.history()]


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_the_registry_refuses_an_unverified_rollback_and_records_a_verified_one(
    registry, promoted, approver_keys
):
    parent, cand = promoted
    before = _moves(registry)
    valid = signed_rollback(registry, parent.version, "alice", approver_keys, reason="canary regressed")
    forged = signed_rollback(registry, parent.version, "mallory", {"mallory": approver_keys["mallory"]})
    refused = [
        valid.model_copy(update={"signature": ""}),
        forged.model_copy(update={"actor": "alice"}),
        signed_rollback(registry, parent.version, "bob", approver_keys),
        signed_rollback(registry, "999", "alice", approver_keys).model_copy(
            update={"target_version": parent.version}
        ),
    ]
    for request in refused:
        with pytest.raises(RollbackRefused, match="^rollback refused: rollback to "):
            rollbacks.rollback(registry, request)
    assert _moves(registry) == before

    result = rollbacks.rollback(registry, valid)
    assert result.mirrored and _moves(registry) == [*before, (cand.version, parent.version, "alice")]
    note = json.loads(registry.history()[-1].note)
    assert note["note"] == "rollback" and note["role"] == "default-approver"
    assert (note["reason"], note["signature"], note["signed_at"]) == (
        "canary regressed",
        valid.signature,
        valid.at,
    )
    with pytest.raises(NotAuthorized, match="signs a rollback from version"):  # once only
        rollbacks.rollback(registry, valid)


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_cli_and_job_refuse_an_unverified_rollback_in_one_line_and_record_a_signed_one(
    registry, promoted, tracking, roles_file, approver_keys, tmp_path, monkeypatch, capsys
):
    import dagster as dg

    from lightning_dagster.cli import main
    from lightning_dagster.orchestration.jobs import rollback
    from lightning_dagster.orchestration.resources import (
        GateResource,
        MLflowResource,
        StoreResource,
        default_pipeline,
    )

    parent, cand = promoted
    before = _moves(registry)
    common = ["--tracking-uri", tracking.uri, "--model-name", registry.model_name]
    monkeypatch.setenv("LD_STORE_URL", registry.store.url)

    # `sign-rollback` prints the job's run config; an edited copy of it is refused by the CLI and the job.
    argv = ["registry", "sign-rollback", parent.version, "--actor", "alice", "--reason", "regressed"]
    assert main([*argv, "--key", str(approver_keys["alice"]), *common]) == 0
    signed = json.loads(capsys.readouterr().out)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**signed, "reason": "edited after signing"}))
    assert main(["registry", "rollback", "--signed", str(edited), *common]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rollback refused: ") and err.count("\n") == 1
    assert "signature does not verify with alice's key" in err
    wrong_key = ["--actor", "alice", "--key", str(approver_keys["bob"]), "--reason", "x"]
    assert main(["registry", "rollback", parent.version, *wrong_key, *common]) == 1
    assert "does not verify" in capsys.readouterr().err
    assert main(["registry", "rollback", parent.version, "--actor", "alice", *common]) == 2  # no key
    assert "--signed FILE" in capsys.readouterr().err

    pipeline = default_pipeline(
        deferred=False,
        store=StoreResource(url=registry.store.url),
        mlflow=MLflowResource(tracking_uri=tracking.uri, model_name=registry.model_name),
        gate=GateResource(
            roles_path=str(roles_file),
            pipeline_key_path=os.environ["LD_PIPELINE_KEY"],
            roles_admin_key=os.environ["LD_ROLES_ADMIN_KEY"],
        ),
    )

    def job(config: dict) -> dg.ExecuteInProcessResult:
        return rollback.execute_in_process(
            run_config={"ops": {"rollback_default": {"config": config}}},
            resources={"pipeline": pipeline},
            raise_on_error=False,
        )

    # an empty signature is refused by the job's config, naming the field, before the op runs
    empty = job({**signed, "signature": ""})
    (failure,) = [e for e in empty.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.step_failure_data.error
    while error.cause is not None:
        error = error.cause
    assert "RollbackConfig\nsignature\n  String should have at least 1 character" in error.message
    for config, refused in (
        ({**signed, "reason": "edited after signing"}, "RollbackRefused"),
        ({**signed, "actor": "bob"}, "RollbackRefused"),
        ({**signed, "reason": " "}, "InvalidInput"),
    ):
        result = job(config)
        assert not result.success
        (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        assert "Failure: rollback refused: " in failure.step_failure_data.error.message
        assert failure.step_failure_data.user_failure_data.metadata["refused"].value == refused
    assert _moves(registry) == before

    assert job(signed).success
    assert _moves(registry) == [*before, (cand.version, parent.version, "alice")]
    assert not job(signed).success  # the move it signed is no longer the pointer's newest
