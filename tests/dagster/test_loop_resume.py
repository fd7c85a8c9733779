"""Hostile or careless resumes of the paused loop, on a store of their own (no training, no MLflow): each is
a named refusal (CLI exit status, a one-line failure of the `resume` job) and the history stays as it was;
a history that cannot be read is named, and one odd record does not make the rest unreadable."""

from __future__ import annotations

import os

import dagster as dg
import pytest

from lightning_dagster.demo import approver_keys
from lightning_dagster.pipeline import loop_history
from lightning_dagster.release.pauses import LoopDecision
from lightning_dagster.release.roles import deployment_roles
from lightning_dagster.store import Store


@pytest.fixture
def store(tmp_path, monkeypatch) -> Store:
    """A store whose loop is paused on receipt rcpt-1, with the session's approvers pinned."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("LD_STORE_URL", url)
    store = Store(url)
    deployment_roles(store, os.environ["LD_ROLES_FILE"])
    assert loop_history.tick(store, "rcpt-1", ["protected set regressed"], []).paused
    return store


def _signed(store, **kw):
    fields = {"actor": "bob", "role": "default-approver", "key": approver_keys() / "bob.key", "reason": "ok"}
    return loop_history.sign_resume(store, **{**fields, **kw})


def _actors(store):
    return deployment_roles(store, os.environ["LD_ROLES_FILE"]).actors


def _loop(*argv: str) -> int:
    from lightning_dagster.cli import main

    return main(["loop", *argv])


def test_a_resume_dated_ahead_of_the_clock_or_before_the_pause_is_refused_and_not_recorded(store):
    pause = loop_history.current_pause(store)
    for at in (1e20, 1.0, pause.decision.at - 3600):
        with pytest.raises(loop_history.ResumeRefused, match="ahead of the clock|before the pause"):
            loop_history.resume(store, _signed(store, at=at), actors=_actors(store))
    assert [r.hash for r in loop_history.history(store)] == [pause.hash]
    recorded = loop_history.resume(store, _signed(store), actors=_actors(store))
    assert recorded.decision.action == "resume" and loop_history.current_pause(store) is None


def test_a_resume_racing_another_decision_is_refused_not_a_raw_conflict(store, monkeypatch):
    request = _signed(store)
    read = loop_history.current_pause

    def racing(store_, loop=loop_history.LOOP):
        found = read(store_, loop)
        loop_history.tick(store_, "rcpt-2", [], [])  # a clearing receipt resumes the loop meanwhile
        return found

    monkeypatch.setattr(loop_history, "current_pause", racing)
    with pytest.raises(loop_history.ResumeRefused, match="another decision was recorded"):
        loop_history.resume(store, request, actors=_actors(store))
    monkeypatch.undo()
    assert [(r.decision.action, r.decision.by) for r in loop_history.history(store)] == [
        ("pause", "gate"),
        ("resume", "receipt"),
    ]


def test_an_odd_time_in_a_recorded_decision_leaves_the_history_readable(store):
    # Recorded before resumes' times were bounded: a time beyond any calendar.
    head = loop_history.history(store)[-1]
    odd = LoopDecision(
        action="resume",
        by="actor",
        at=1e20,
        receipt_id="rcpt-1",
        actor="bob",
        role="default-approver",
        reason="x",
    )
    recorded = loop_history._append(store, odd, head)
    table = loop_history.history_table(store)
    assert table.rows[-1][1] == "1e+20 (not a calendar time)"
    assert loop_history.decision_metadata(store, recorded)["loop_history"].rows == table.rows  # the UI's view
    assert loop_history.tick(store, "rcpt-1", ["protected set regressed"], []).paused is False
    assert _loop("history") == 0
    with pytest.raises(ValueError, match="positive"):
        loop_history.history_table(store, last=0)


def test_a_history_version_that_verifies_but_is_no_decision_is_named(store):
    head = loop_history.history(store)[-1]
    body = {"action": "pause", "by": "someone", "at": 1.0}
    digest = loop_history._hash(body, head.hash)
    store.append_document(loop_history.COLLECTION, loop_history.LOOP, digest, body, head.hash)
    with pytest.raises(loop_history.TamperedHistory, match="version 2 is not a loop decision"):
        loop_history.history(store)
    assert _loop("status") == 1 and _loop("history") == 1


@pytest.mark.parametrize(
    "reason",
    ["", "   ", "ok\x00", "ok\x1b]0;pwned\x07", "x" * 5000],
    ids=["empty", "blank", "nul", "esc", "huge"],
)
def test_cli_resume_with_a_bad_reason_is_invalid_input_and_records_nothing(store, reason, capsys):
    key = str(approver_keys() / "bob.key")
    assert _loop("resume", "--actor", "bob", "--key", key, "--reason", reason) == 2
    assert "invalid input: invalid resume: reason" in capsys.readouterr().err
    assert _loop("sign", "--actor", "", "--key", key, "--reason", "ok") == 2
    assert len(loop_history.history(store)) == 1 and loop_history.current_pause(store) is not None


@pytest.mark.parametrize("last", ["0", "-2", "many"])
def test_cli_history_needs_a_positive_count(store, last):
    with pytest.raises(SystemExit) as exit_:
        _loop("history", "--last", last)
    assert exit_.value.code == 2


def _resume_job(store, config: dict) -> dg.ExecuteInProcessResult:
    from lightning_dagster.orchestration.jobs import resume
    from lightning_dagster.orchestration.resources import GateResource, StoreResource, default_pipeline

    pipeline = default_pipeline(
        deferred=False,
        store=StoreResource(url=store.url),
        gate=GateResource(roles_path=os.environ["LD_ROLES_FILE"]),
    )
    return resume.execute_in_process(
        run_config={"ops": {"resume_loop": {"config": config}}},
        resources={"pipeline": pipeline},
        raise_on_error=False,
    )


@pytest.mark.parametrize(
    "edit, refused",
    [
        ({"signature": ""}, "config"),  # unsigned: the config refuses "" by name
        ({"actor": "alice"}, "ResumeRefused"),  # a release-owner, not a default-approver
        ({"reason": "edited after signing"}, "ResumeRefused"),
        ({"reason": "  "}, "InvalidInput"),
        ({"actor": ""}, "config"),
        ({"at": 1e20}, "ResumeRefused"),
    ],
)
def test_the_resume_job_refuses_in_one_named_line_and_records_nothing(store, edit, refused):
    config = {**_signed(store).model_dump(mode="json"), **edit}
    result = _resume_job(store, config)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.step_failure_data.error
    if refused == "config":
        while error.cause is not None:
            error = error.cause
        (field,) = edit
        assert f"ResumeConfig\n{field}\n  String should have at least 1 character" in error.message
    else:
        assert error.cls_name == "Failure" and "Failure: resume refused: " in error.message
        assert failure.step_failure_data.user_failure_data.metadata["refused"].value == refused
    assert len(loop_history.history(store)) == 1


def test_the_resume_job_records_a_signed_resume_once(store):
    config = _signed(store).model_dump(mode="json")
    assert _resume_job(store, config).success
    again = _resume_job(store, config)  # the same signed resume again: the pause it signed is lifted
    assert not again.success
    assert [r.decision.action for r in loop_history.history(store)] == ["pause", "resume"]


# ---------------------------------------------------------------- a deployment with its own resume roles


@pytest.fixture
def owned(tmp_path, monkeypatch):
    """A deployment whose gate lets `loop-owner` (carol) resume, not `default-approver` (bob): its roles
    pinned in a store of its own, its loop paused by the gate's rule (no approved parent resolves), recorded
    as the stage that judges a receipt records it."""
    from lightning_dagster.orchestration.resources import (
        GateResource,
        MLflowResource,
        StoreResource,
        default_pipeline,
    )
    from lightning_dagster.pipeline.triggers import stop_decision
    from lightning_dagster.release.signing import generate_keypair

    keys = tmp_path / "keys"
    pairs = {a: generate_keypair(a, keys) for a in ("carol", "bob")}
    roles = {"carol": "loop-owner", "bob": "default-approver"}
    entries = "".join(pairs[a].roles_entry([r]) for a, r in roles.items())
    (tmp_path / "roles.yaml").write_text("actors:\n" + entries)
    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("LD_STORE_URL", url)
    monkeypatch.setenv("LD_ROLES_FILE", str(tmp_path / "roles.yaml"))  # what `loop resume` reads
    pipeline = default_pipeline(
        deferred=False,
        store=StoreResource(url=url),
        mlflow=MLflowResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
        gate=GateResource(roles_path=str(tmp_path / "roles.yaml"), default_approver_roles=["loop-owner"]),
    )
    store = pipeline.get_store()
    deployment_roles(store, tmp_path / "roles.yaml")
    assert stop_decision(pipeline, [], record=True).pause
    return pipeline, keys


def _job(pipeline, request) -> dg.ExecuteInProcessResult:
    from lightning_dagster.orchestration.jobs import resume

    return resume.execute_in_process(
        run_config={"ops": {"resume_loop": {"config": request.model_dump(mode="json")}}},
        resources={"pipeline": pipeline},
        raise_on_error=False,
    )


def _cli_resume(keys, actor: str, role: str | None) -> int:
    role_args = ["--role", role] if role else []
    return _loop(
        "resume", "--actor", actor, "--key", str(keys / f"{actor}.key"), "--reason", "ok", *role_args
    )


def test_the_pause_names_the_deployments_resume_roles_and_the_cli_shows_them(owned, capsys):
    pipeline, _ = owned
    pause = loop_history.current_pause(pipeline.get_store())
    assert pause.decision.resume_roles == ["loop-owner"] and loop_history.pause_roles(pause) == ["loop-owner"]
    assert _loop("status") == 0
    assert "may resume: loop-owner" in capsys.readouterr().out


@pytest.mark.parametrize(
    "actor, role",
    [("bob", "default-approver"), ("bob", "loop-owner"), ("carol", "default-approver")],
    ids=["default-role", "role-not-held", "carol-in-the-default-role"],
)
def test_cli_and_job_refuse_alike_outside_the_deployments_resume_roles(owned, actor, role, capsys):
    pipeline, keys = owned
    store = pipeline.get_store()
    before = [r.hash for r in loop_history.history(store)]
    assert _cli_resume(keys, actor, role) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("refused: resume by ") and "\n" not in err
    request = loop_history.sign_resume(store, actor=actor, role=role, key=keys / f"{actor}.key", reason="ok")
    result = _job(pipeline, request)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    job_reason = failure.step_failure_data.user_failure_data.metadata["reason"].value
    assert job_reason == err.removeprefix("refused: ")  # the same one-line reason
    if role != "loop-owner":
        assert "may not resume (allowed: ['loop-owner'])" in err
    assert [r.hash for r in loop_history.history(store)] == before


def test_cli_and_job_both_accept_a_signed_resume_in_the_deployments_role(owned):
    pipeline, keys = owned
    store = pipeline.get_store()
    assert _cli_resume(keys, "carol", None) == 0  # the role defaults to the pause's first
    resumed = loop_history.history(store)[-1].decision
    assert (resumed.action, resumed.actor, resumed.role) == ("resume", "carol", "loop-owner")
    assert loop_history.tick(store, None, [], ["parent unavailable: x"], resume_roles=["loop-owner"]).paused
    request = loop_history.sign_resume(
        store, actor="carol", role="loop-owner", key=keys / "carol.key", reason="ok"
    )
    assert _job(pipeline, request).success
    assert [r.decision.action for r in loop_history.history(store)] == ["pause", "resume", "pause", "resume"]
