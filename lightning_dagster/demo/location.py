"""The code location the demo's printed `dagster dev` serves, loaded as that command loads it (a gRPC
server process), so the UI shows the demo's ticks (the sensor daemon's own) and runs (made as the launchpad
makes them, queued, then launched in the demo's process, which follows their events)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

MODULE = "lightning_dagster.orchestration.definitions"
# The sensor daemon logs through this; the demo prints its own lines.
LOG = logging.getLogger("lightning_dagster.demo.sensor")


class Location:
    """The loaded code location, on `instance`; use as a context manager (it ends the location's process)."""

    def __init__(self, instance: Any) -> None:
        from dagster._core.workspace.context import WorkspaceProcessContext
        from dagster._core.workspace.load_target import ModuleTarget

        self.instance = instance
        target = ModuleTarget(module_name=MODULE, attribute=None, working_directory=None, location_name=None)
        self.context = WorkspaceProcessContext(instance, target, code_server_log_level="WARNING")

    def __enter__(self) -> Location:
        return self

    def __exit__(self, *exc: object) -> None:
        self.context.__exit__(*exc)

    def code_location(self) -> Any:
        (entry,) = self.context.create_request_context().get_code_location_entries().values()
        if entry.code_location is None:
            error = entry.load_error.to_string() if entry.load_error else "not loaded"
            raise RuntimeError(f"the code location {MODULE} did not load: {error}")
        return entry.code_location

    def repository(self) -> Any:
        (repository,) = self.code_location().get_repositories().values()
        return repository

    @property
    def name(self) -> str:
        return self.code_location().name

    def tick(self, sensor_name: str, cursor: str | None) -> Any:
        """One tick of `sensor_name` from `cursor` by the daemon's machinery; the recorded tick (`status`,
        `skip_reason`, `run_ids`). The sensor keeps its status; the demo ticks when it has something to
        show, not on the minimum interval."""
        from dagster._core.definitions.run_request import InstigatorType
        from dagster._daemon.sensor import _process_tick_generator

        sensor = self.repository().get_sensor(sensor_name)
        state = self.set_cursor(sensor_name, cursor, ticked=False)
        retention = self.instance.get_tick_retention_settings(InstigatorType.SENSOR)
        for error in _process_tick_generator(self.context, LOG, sensor, state, None, retention, None):
            if error is not None:
                raise RuntimeError(f"{sensor_name}'s tick failed: {error.to_string()}")
        tick = self.instance.get_ticks(sensor.get_remote_origin_id(), sensor.selector_id, limit=1)[0]
        if tick.error is not None:
            raise RuntimeError(f"{sensor_name}'s tick failed: {tick.error.to_string()}")
        return tick

    def cursor(self, sensor_name: str) -> str | None:
        sensor = self.repository().get_sensor(sensor_name)
        state = self.instance.get_instigator_state(sensor.get_remote_origin_id(), sensor.selector_id)
        return state.instigator_data.cursor if state is not None and state.instigator_data else None

    def set_cursor(self, sensor_name: str, cursor: str | None, *, ticked: bool = True) -> Any:
        """Set the sensor's cursor as `dagster sensor cursor --set` does; returns its state."""
        from dagster._core.definitions.run_request import InstigatorType
        from dagster._core.definitions.sensor_definition import DefaultSensorStatus
        from dagster._core.scheduler.instigation import (
            InstigatorState,
            InstigatorStatus,
            SensorInstigatorData,
        )

        sensor = self.repository().get_sensor(sensor_name)
        ids = sensor.get_remote_origin_id(), sensor.selector_id
        state = self.instance.get_instigator_state(*ids)
        old = state.instigator_data if state is not None else None
        data = SensorInstigatorData(
            last_tick_timestamp=old.last_tick_timestamp if old and ticked else None,
            last_run_key=old.last_run_key if old else None,
            min_interval=sensor.min_interval_seconds,
            cursor=cursor,
            last_tick_start_timestamp=old.last_tick_start_timestamp if old and ticked else None,
            last_sensor_start_timestamp=old.last_sensor_start_timestamp if old else None,
            sensor_type=sensor.sensor_type,
            last_tick_success_timestamp=old.last_tick_success_timestamp if old and ticked else None,
        )
        if state is None:
            running = sensor.default_status == DefaultSensorStatus.RUNNING
            status = InstigatorStatus.DECLARED_IN_CODE if running else InstigatorStatus.STOPPED
            self.instance.add_instigator_state(
                InstigatorState(sensor.get_remote_origin(), InstigatorType.SENSOR, status, data)
            )
        else:
            self.instance.update_instigator_state(state.with_data(data))
        return self.instance.get_instigator_state(*ids)

    def submit(
        self,
        job_name: str,
        run_config: dict[str, Any],
        *,
        partition: str | None = None,
        assets: Iterable[str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> Any:
        """A queued run of the location's `job_name` (only `assets`, if given), made as the launchpad does."""
        import dagster as dg
        from dagster._core.definitions.selector import JobSubsetSelector

        location, repository = self.code_location(), self.repository()
        selection = [dg.AssetKey(name) for name in assets] if assets is not None else None
        selector = JobSubsetSelector(
            location_name=location.name,
            repository_name=repository.name,
            job_name=job_name,
            op_selection=None,
            asset_selection=selection,
        )
        job = location.get_job(selector)
        plan = location.get_execution_plan(
            job, run_config, step_keys_to_execute=None, known_state=None, instance=self.instance
        )
        tags = {
            **(job.run_tags or {}),
            **(tags or {}),
            **({"dagster/partition": partition} if partition else {}),
        }
        run = self.instance.create_run(
            job_name=job_name,
            run_id=None,
            run_config=run_config,
            resolved_op_selection=job.resolved_op_selection,
            step_keys_to_execute=None,
            op_selection=None,
            status=None,
            root_run_id=None,
            parent_run_id=None,
            tags=tags,
            job_snapshot=job.job_snapshot,
            execution_plan_snapshot=plan.execution_plan_snapshot,
            parent_job_snapshot=job.parent_job_snapshot,
            remote_job_origin=job.get_remote_origin(),
            job_code_origin=job.get_python_origin(),
            asset_selection=frozenset(selection) if selection is not None else None,
            asset_check_selection=None,
            asset_graph=repository.asset_graph,
        )
        return self.instance.submit_run(run.run_id, self.context.create_request_context())

    def launch(self, run_id: str, job_def: Any, on_event: Callable[[Any], None]) -> Any:
        """Launch the queued run `run_id` here as a run worker would, each event to `on_event`."""
        from dagster._core.definitions.job_base import InMemoryJob
        from dagster._core.events import DagsterEvent, DagsterEventType
        from dagster._core.execution.api import execute_run_iterator

        run = self.instance.get_run_by_id(run_id)
        starting = DagsterEvent(
            event_type_value=DagsterEventType.PIPELINE_STARTING.value, job_name=run.job_name
        )
        self.instance.report_dagster_event(starting, run_id=run_id)
        run = self.instance.get_run_by_id(run_id)
        for event in execute_run_iterator(InMemoryJob(job_def), run, self.instance):
            on_event(event)
        return self.instance.get_run_by_id(run_id)
