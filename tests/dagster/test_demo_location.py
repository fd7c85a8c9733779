"""The demo's ticks and runs are the code location's, without training: on an empty home, a tick of
`continual_learning_sensor` through the location is recorded under the location's sensor with its skip reason
(the loop has no parent yet), and a `promote` run submitted through it is the location's run of that job,
queued as Dagster queues runs, launched in the caller's process and failed with the refusal's one line."""

from __future__ import annotations

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef
from dagster._core.scheduler.instigation import InstigatorStatus, TickStatus

from lightning_dagster.demo.location import MODULE, Location
from lightning_dagster.orchestration.definitions import build_definitions

REPOSITORY = {".dagster/repository": f"__repository__@{MODULE}"}


@pytest.mark.slow
def test_a_tick_and_a_run_through_the_location_are_recorded_as_the_locations(tmp_path, monkeypatch):
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    ref = InstanceRef.from_dir(str(dagster_home), overrides={"python_logs": {"python_log_level": "CRITICAL"}})
    with dg.DagsterInstance.from_ref(ref) as instance, Location(instance) as location:
        assert location.name == MODULE
        tick = location.tick("continual_learning_sensor", None)
        assert tick.status == TickStatus.SKIPPED
        assert tick.skip_reason.startswith("paused: parent unavailable: approved-default is not set")
        # the tick is the location's sensor's, as its page reads them; the sensor stays off
        (state,) = [s for s in instance.all_instigator_state() if s.name == "continual_learning_sensor"]
        assert state.origin.repository_origin.code_location_origin.location_name == MODULE
        assert state.status == InstigatorStatus.STOPPED
        assert [t.tick_id for t in instance.get_ticks(state.instigator_origin_id, state.selector_id)] == [
            tick.tick_id
        ]
        assert location.cursor("continual_learning_sensor") is not None  # what the tick decided
        location.set_cursor("continual_learning_sensor", '{"pool": "p"}')
        assert location.cursor("continual_learning_sensor") == '{"pool": "p"}'

        fields = {"receipt_id": "rcpt-none", "actor": "bob", "role": "default-approver", "seq": 2, "at": 1.0}
        config = {"ops": {"promote_candidate": {"config": {**fields, "signature": "s"}}}}
        queued = location.submit("promote", config)
        assert queued.status == dg.DagsterRunStatus.QUEUED and queued.remote_job_origin is not None
        events = []
        done = location.launch(queued.run_id, build_definitions().resolve_job_def("promote"), events.append)
        assert done.status == dg.DagsterRunStatus.FAILURE
        (failure,) = [e for e in events if e.is_step_failure]
        assert failure.step_failure_data.user_failure_data.description.startswith("promotion refused: ")
        listed = instance.get_runs(dg.RunsFilter(job_name="promote", tags=REPOSITORY))
        assert [r.run_id for r in listed] == [queued.run_id]
