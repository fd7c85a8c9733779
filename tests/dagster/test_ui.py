"""The Dagster UI in a real browser: dagster-webserver on 127.0.0.1 serving this code location, headless
Chromium opens the asset graph, launches a materialization of one snapshot partition, and waits for it; with
`LD_PROJECT` set, the `tasks` asset's metadata shows the user's project, harness and dataset."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
import yaml

from tests.dagster.test_pipeline_core import UNSIGNED
from tests.support.browser import chromium, needs_chromium

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
KEY = "snap-20261130T1000Z-0000ui01"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    needs_chromium,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(
    tmp_path: Path,
    workspace: Path = ROOT / "workspace.yaml",
    *,
    dagster_home: Path | None = None,
    target: list[str] | None = None,
    **env_extra: str,
):
    """`dagster-webserver -w WORKSPACE` (or `target`, e.g. `-m MODULE`) with a fresh DAGSTER_HOME (Dagster's
    default SQLite instance), or a copy of `dagster_home`."""
    fresh = dagster_home is None
    home = tmp_path / "dagster_home"
    if fresh:
        home.mkdir()
    else:
        shutil.copytree(dagster_home, home)
    dagster_home = home
    # No daemon in this test: the default coordinator launches a run straight from the UI instead of queueing
    # it for the daemon (dagster.yaml's QueuedRunCoordinator is for real deployments under `dagster dev`).
    (dagster_home / "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster.core.run_coordinator\n  class: DefaultRunCoordinator\n"
        "telemetry:\n  enabled: false\n"
    )
    instance = dg.DagsterInstance.from_config(str(dagster_home))
    if fresh:
        instance.add_dynamic_partitions("snapshots", [KEY])
    port = _free_port()
    env = {
        **os.environ,
        "LIGHTNING_DAGSTER_HOME": str(tmp_path / "home"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **env_extra,
        # the copy, whatever the caller's environment names (a demo's printed commands name its own home)
        "DAGSTER_HOME": str(dagster_home),
    }
    log = open(tmp_path / "webserver.log", "w")
    proc = subprocess.Popen(
        [
            str(Path(os.sys.executable).parent / "dagster-webserver"),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            *(target or ["-w", str(workspace)]),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            urllib.request.urlopen(f"{url}/server_info", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError((tmp_path / "webserver.log").read_text()[-3000:]) from None
            time.sleep(0.5)
    try:
        yield url, instance
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture
def webserver(tmp_path):
    with serve(tmp_path) as served:
        yield served


@pytest.fixture
def browser(tmp_path):
    with chromium(tmp_path / "chromium-profile") as driver:
        yield driver


def _click(driver, xpath: str, timeout: float = 60, *, click: bool = True) -> None:
    """Click (or with `click=False` just wait for) the last visible element matching `xpath`. The UI
    re-renders and may open its welcome dialog over the page at any time, so retry until `timeout`."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    deadline = time.time() + timeout
    while True:
        _dismiss_welcome(driver)
        try:
            found = [e for e in driver.find_elements(By.XPATH, xpath) if e.is_displayed() and e.is_enabled()]
            if found:
                if click:
                    found[-1].click()
                return
        except WebDriverException:  # stale element, or a click intercepted by an overlay
            pass
        if time.time() > deadline:
            raise TimeoutError(f"nothing {'clickable' if click else 'visible'} at {xpath}")
        time.sleep(0.5)


def _dismiss_welcome(driver) -> None:
    """The 'Join the Dagster community' dialog a fresh instance shows once: press its Skip button."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    try:
        for button in driver.find_elements(By.XPATH, "//button[normalize-space(.)='Skip']"):
            if button.is_displayed():
                button.click()
    except WebDriverException:
        pass


def _materialize_from_the_ui(
    browser, url: str, instance, page: str, title: str, timeout: float = 120
) -> dg.DagsterRun:
    """Press Materialize on `page` for partition KEY (the dialog is titled `title`) and wait for the run."""
    started = len(instance.get_runs())
    browser.get(f"{url}{page}")
    # A press while the page is still loading its asset data can open nothing: load it again and press again
    # (a screenshot of the page as it was is kept with the test artifacts).
    for attempt in range(3):
        _click(browser, "//button[starts-with(normalize-space(.), 'Materialize')]", timeout=120)
        try:
            _click(browser, "//*[contains(text(), 'Select a partition')]", timeout=30)
            break
        except TimeoutError:
            ARTIFACTS.mkdir(exist_ok=True)
            browser.save_screenshot(str(ARTIFACTS / f"no-partition-picker-{attempt}.png"))
            if attempt == 2:
                raise
            browser.get(f"{url}{page}")
    _click(browser, f"//span[normalize-space(text())='{KEY}']")
    _click(browser, f"//*[starts-with(normalize-space(text()), '{title}')]")  # close the picker
    _click(browser, "//button[starts-with(normalize-space(.), 'Launch')]")
    return _wait_for_run(instance, started, timeout)


def _launch_from_the_launchpad(browser, launchpad: str, instance, timeout: float) -> dg.DagsterRun:
    """Open `launchpad` (a job's launchpad URL with its config), press Launch Run once the config reads valid
    ("No errors"), and wait for the run; a press that launched nothing (the page still loading) is repeated on
    the page opened again, a screenshot of the page kept."""
    started = len(instance.get_runs())
    for attempt in range(3):
        browser.get(launchpad)
        _click(browser, "//*[normalize-space(text())='No errors']", timeout=120, click=False)
        _click(browser, "//button[contains(normalize-space(.), 'Launch Run')]", timeout=120)
        deadline = time.time() + 30
        while time.time() < deadline and len(instance.get_runs()) == started:
            time.sleep(1)
        if len(instance.get_runs()) > started:
            return _wait_for_run(instance, started, timeout)
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / f"launchpad-launched-nothing-{attempt}.png"))
    raise TimeoutError("Launch Run launched no run in three presses")


def _wait_for_run(instance, started: int, timeout: float) -> dg.DagsterRun:
    """The run launched after `started` runs existed, once it has finished."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = instance.get_runs()
        if len(runs) > started and runs[0].is_finished:
            return runs[0]
        time.sleep(1)
    raise TimeoutError(f"no run finished within {timeout} s")


def _materialize_tasks_from_the_ui(browser, url: str, instance) -> dg.DagsterRun:
    return _materialize_from_the_ui(
        browser, url, instance, "/assets/tasks", "Launch runs to materialize tasks"
    )


def _screenshot(browser, name: str) -> None:
    """A test artifact, without the welcome dialog a fresh instance opens a moment after the page."""
    time.sleep(2)
    _dismiss_welcome(browser)
    time.sleep(1)
    browser.save_screenshot(str(ARTIFACTS / name))


def test_launch_a_materialization_from_the_asset_graph(webserver, browser):
    url, instance = webserver
    ARTIFACTS.mkdir(exist_ok=True)
    browser.get(f"{url}/asset-groups")
    # The lineage graph has rendered its group nodes (the sidebar lists the same names, so look in the SVG).
    _click(
        browser,
        "//*[local-name()='svg']//*[normalize-space(text())='release'] | //*[contains(@class,'GroupNode')]",
        timeout=120,
        click=False,
    )
    time.sleep(2)  # the welcome dialog opens a moment after the page; keep it out of the screenshot
    _dismiss_welcome(browser)
    time.sleep(1)
    browser.save_screenshot(str(ARTIFACTS / "dagster-asset-graph.png"))

    run = _materialize_tasks_from_the_ui(browser, url, instance)
    assert run.status == dg.DagsterRunStatus.SUCCESS, run.status
    assert run.tags["dagster/partition"] == KEY
    event = instance.get_latest_materialization_event(dg.AssetKey("tasks"))
    assert event is not None and event.asset_materialization.partition == KEY

    browser.get(f"{url}/runs/{run.run_id}")
    _click(browser, "//*[contains(text(), 'Success') or contains(text(), 'success')]", timeout=60)
    browser.save_screenshot(str(ARTIFACTS / "dagster-run-success.png"))


def test_with_ld_project_the_tasks_asset_shows_the_users_project_harness_and_dataset(tmp_path, browser):
    project = tmp_path / "node-agent"
    shutil.copytree(ROOT / "examples" / "node-agent", project)
    ARTIFACTS.mkdir(exist_ok=True)
    with serve(tmp_path, LD_PROJECT=str(project)) as (url, instance):
        run = _materialize_tasks_from_the_ui(browser, url, instance)
        assert run.status == dg.DagsterRunStatus.SUCCESS, run.status
        event = instance.get_latest_materialization_event(dg.AssetKey("tasks"))
        metadata = event.asset_materialization.metadata
        assert metadata["project"].value == "node-agent" and metadata["harness_kind"].value == "command"
        assert metadata["dataset"].value == str(project / "tasks.jsonl")
        # What the asset's page shows for that materialization: the same three values.
        browser.get(f"{url}/assets/tasks?view=events&partition={KEY}")
        for text in ("node-agent", "command", str(project / "tasks.jsonl")):
            _click(browser, f"//*[contains(text(), '{text}')]", timeout=60, click=False)
        _click(browser, "//*[contains(text(), 'dataset_hash')]", click=False)
        time.sleep(2)  # the welcome dialog opens a moment after the page; keep it out of the screenshot
        _dismiss_welcome(browser)
        time.sleep(1)
        browser.save_screenshot(str(ARTIFACTS / "dagster-user-project-tasks.png"))


def test_a_cycle_started_from_the_ui_is_judged_on_its_merits_and_a_refused_promotion_reads_in_one_line(
    tmp_path, browser, bootstrapped
):
    """The code location (with the tests' tiny training as its defaults and a policy made for them) runs a
    whole snapshot launched from the UI; the plan can pass, so the verdict rests on the evidence: HOLD for the
    missing approval alone. The stale-evidence sensor then finds nothing stale, `promote` launched on the
    HOLD receipt fails with the one-line refusal, and release_receipt's page names the candidate version."""
    from urllib.parse import quote

    from lightning_dagster.orchestration.sensors import stale_evidence_sensor
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.pipeline.report import run_config
    from tests.dagster.conftest import TINY_POLICY, pipeline_for

    ARTIFACTS.mkdir(exist_ok=True)
    workspace = tmp_path / "workspace.yaml"
    location = {"module_name": "tests.dagster.ui_location", "location_name": "lightning_dagster"}
    workspace.write_text(yaml.safe_dump({"load_from": [{"python_module": location}]}))
    env = {"LIGHTNING_DAGSTER_HOME": str(bootstrapped), "LD_GATE_POLICY": str(TINY_POLICY)}
    p = pipeline_for(TINY_POLICY)
    with serve(tmp_path, workspace, **env) as (url, instance):
        job = f"{url}/locations/lightning_dagster/jobs"
        cycle = _materialize_from_the_ui(
            browser,
            url,
            instance,
            "/locations/lightning_dagster/jobs/continual_learning",
            "Launch runs to materialize",
            timeout=900,
        )
        # Only check 7 (no approval yet, judged on rollback_drill) may fail in that run; any other step is a bug.
        failed = {
            e.step_key: e.dagster_event.event_specific_data.error.to_string()
            for e in instance.all_logs(cycle.run_id)
            if e.dagster_event and e.dagster_event.is_step_failure
        }
        assert set(failed) <= {"rollback_drill_rollback_and_approval"}, failed
        plan = instance.get_latest_materialization_event(dg.AssetKey("update_plan")).asset_materialization
        assert plan.metadata["plan_can_pass"].value is True
        # Check 7 (no approval yet) blocked release_receipt in that run; materialized alone it re-judges all.
        _materialize_from_the_ui(
            browser,
            url,
            instance,
            "/assets/release_receipt",
            "Launch runs to materialize release_receipt",
            timeout=300,
        )
        receipt = ctx.find_receipt(p.get_store(), KEY)
        assert receipt.gate.verdict == "HOLD"
        assert receipt.gate.failed_checks + receipt.gate.unavailable_checks == [7]

        # A sensor tick over this receipt, with the code location's settings: nothing is stale.
        with dg.build_sensor_context(instance=instance, resources={"pipeline": p}) as context:
            ticked = stale_evidence_sensor(context)
        assert not ticked.asset_events

        # release_receipt's page: the verdict and the candidate version it judged.
        browser.get(f"{url}/assets/release_receipt?partition={KEY}")
        meta = instance.get_latest_materialization_event(dg.AssetKey("release_receipt")).asset_materialization
        assert meta.metadata["candidate_version"].value == receipt.candidate.model_version
        _click(browser, "//*[normalize-space(text())='candidate_version']", click=False)
        _click(browser, "//*[contains(text(), 'HOLD')]", click=False)
        _screenshot(browser, "dagster-release-receipt.png")

        # promote on the HOLD receipt, launched with the run config release_receipt's metadata gives.
        started = len(instance.get_runs())
        config = run_config("promote_candidate", receipt_id=receipt.receipt_id, actor="bob", **UNSIGNED)
        browser.get(f"{job}/promote/playground/setup?config={quote(config)}")
        _click(browser, "//button[contains(normalize-space(.), 'Launch Run')]", timeout=120)
        run = _wait_for_run(instance, started, 120)
        assert run.status == dg.DagsterRunStatus.FAILURE
        browser.get(f"{url}/runs/{run.run_id}")
        _click(browser, "//*[contains(text(), 'promotion refused')]", click=False)
        assert "DagsterExecutionStepExecutionError" not in browser.page_source
        _screenshot(browser, "dagster-promote-refused.png")
        (failure,) = [
            e for e in instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.is_step_failure
        ]
        description = failure.dagster_event.step_failure_data.user_failure_data.description
        assert description.startswith("promotion refused: ") and "HOLD" in description
        assert "\n" not in description


# ---------------------------------------------------------------- after the demo: what a user finds

LOCATION = "lightning_dagster.orchestration.definitions"  # as the demo's printed `dagster dev -m` names it


def _hover_texts(browser, label: str) -> str:
    """The tooltips of every element reading `label` (a tick's status tag keeps its skip reason there)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    _dismiss_welcome(browser)
    time.sleep(1)
    seen = []
    for element in browser.find_elements(By.XPATH, f"//*[normalize-space(text())='{label}']"):
        if element.is_displayed():
            ActionChains(browser).move_to_element(element).perform()
            time.sleep(0.7)
            seen.append(browser.find_element(By.TAG_NAME, "body").text)
    return "\n".join(seen)


def _receipt_metadata(instance, key: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("release_receipt"), asset_partitions=[key]), limit=1
    ).records
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


@pytest.mark.moves_session_pointer(rewrites_approvers=True)
def test_after_the_demo_the_uis_show_its_lineage_receipts_ticks_runs_a_refusal_and_agreeing_verdicts(
    finished_demo, tmp_path, browser
):
    """Dagster's UI and MLflow's, opened on the finished demo's state with the commands it prints: the lineage,
    each snapshot's receipt and the gate checks, the sensor's ticks (each cut with its run, each skip and pause
    with its reason), the `continual_learning` job listing the demo's runs, a promotion launched from the
    launchpad refused with its real reason, and MLflow's versions carrying the verdicts Dagster shows."""
    from urllib.parse import quote, unquote

    from lightning_dagster.orchestration.assets.gate_checks import GATE_CHECKS
    from lightning_dagster.pipeline.report import run_config
    from lightning_dagster.registry import links
    from tests.registry.mlflow_server import MlflowServer
    from tests.support.browser import page_shows

    ARTIFACTS.mkdir(exist_ok=True)
    cycles, env = finished_demo.cycles, finished_demo.env
    home = Path(env["LIGHTNING_DAGSTER_HOME"])
    mlflow = MlflowServer(f"sqlite:///{home / 'mlflow.db'}", tmp_path / "served", tmp_path / "mlflow.log")
    mlflow.start()
    try:
        with serve(
            tmp_path,
            dagster_home=Path(env["DAGSTER_HOME"]),
            target=["-m", LOCATION],
            **env,
            LD_MLFLOW_UI_URL=mlflow.url,
        ) as (url, instance):
            location = f"{url}/locations/{LOCATION}"

            # The lineage: every group of the graph.
            browser.get(f"{url}/asset-groups")
            for group in ("snapshot", "rollouts", "training", "evaluation", "release"):
                _click(browser, f"//*[local-name()='svg']//*[normalize-space(text())='{group}']", click=False)
            _screenshot(browser, "demo-lineage.png")

            # Each snapshot's receipt: its id, verdict and candidate, and the MLflow UI address set now.
            verdicts, model_names = {}, set()
            for cycle in cycles:
                meta = _receipt_metadata(instance, cycle.key)
                verdicts[cycle.key] = meta["verdict"]
                # the registered model the receipt links (the session's home holds other tests' models too)
                model_names.add(unquote(meta["mlflow_model_version_path"].split("/")[2]))
                assert meta["receipt_id"] == cycle.receipt_id and meta["verdict"] == cycle.verdict
                # the partition's own materialization (the overview shows the latest partition's)
                browser.get(f"{url}/assets/release_receipt?view=partitions&partition={cycle.key}")
                page_shows(browser, [cycle.key, cycle.receipt_id, cycle.verdict, meta["candidate_version"]])
                _screenshot(browser, f"demo-receipt-cycle-{cycle.number}.png")
            browser.get(f"{url}/assets/release_receipt")
            page_shows(browser, ["mlflow_ui", mlflow.url])

            # The gate checks, on the asset whose evidence each judges.
            for checks in GATE_CHECKS:
                (asset,) = {key.asset_key.to_user_string() for key in checks.check_keys}
                names = [key.name for key in checks.check_keys]
                browser.get(f"{url}/assets/{asset}?view=checks")
                page_shows(browser, names)
                _screenshot(browser, f"demo-checks-{asset}.png")

            # The sensor's ticks as the demo made them: each cut with its run, each skip with its reason.
            state = next(s for s in instance.all_instigator_state() if s.name == "continual_learning_sensor")
            ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id)
            cut_runs = [run_id for tick in ticks for run_id in tick.run_ids]
            reasons = [tick.skip_reason for tick in ticks if tick.skip_reason]
            assert len(cut_runs) >= 1 and len(reasons) >= 2
            browser.get(f"{location}/sensors/continual_learning_sensor")
            # a skipped tick reads "0 runs requested", its skip reason in the status tag's tooltip
            page_shows(browser, ["0 runs requested", "1 run requested"])
            hovered = _hover_texts(browser, "0 runs requested")
            for reason in reasons:
                assert reason.split(";")[0][:60] in hovered, (reason, hovered)
            _screenshot(browser, "demo-sensor-ticks.png")
            browser.get(f"{url}/automation")
            page_shows(browser, ["continual_learning_sensor", "stale_evidence_sensor"])
            _screenshot(browser, "demo-automation.png")

            # The job's page lists the demo's runs of it, the cuts' launched by the sensor.
            runs = instance.get_runs(dg.RunsFilter(job_name="continual_learning"))
            assert runs and set(cut_runs) <= {r.run_id for r in runs}
            browser.get(f"{location}/jobs/continual_learning/runs")
            body = page_shows(browser, [r.run_id[:8] for r in runs] + ["continual_learning_sensor"])
            assert "No runs found" not in body
            _screenshot(browser, "demo-job-runs.png")

            # promote launched from the launchpad on cycle 2's receipt, which holds no default-step approval:
            # the run fails with the real reason, in one line.
            second = cycles[-1]
            # the fields `registry sign-promote` prints (which itself refuses to sign without the approval): the
            # receipt's approvals are judged before the move's signature
            fields = {"receipt_id": second.receipt_id, "actor": "bob", "role": "default-approver"}
            config = run_config("promote_candidate", **fields, seq=9, at=time.time(), signature="unsigned")
            launchpad = f"{location}/jobs/promote/playground/setup?config={quote(config)}"
            run = _launch_from_the_launchpad(browser, launchpad, instance, 300)
            assert run.status == dg.DagsterRunStatus.FAILURE
            (failure,) = [
                e
                for e in instance.all_logs(run.run_id)
                if e.dagster_event and e.dagster_event.is_step_failure
            ]
            reason = failure.dagster_event.step_failure_data.user_failure_data.description
            assert reason.startswith("promotion refused: ") and "\n" not in reason
            if second.verdict == "PROMOTE TO BOUNDED CANARY" and not second.promoted:
                assert "holds no signed default-step approval by 'bob'" in reason, reason
            browser.get(f"{url}/runs/{run.run_id}")
            page_shows(browser, [reason[:80]])
            _screenshot(browser, "demo-promote-refused.png")

        # MLflow's model versions carry the verdicts Dagster shows; the model page lists them.
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        (name,) = model_names
        model = client.get_registered_model(name)
        for cycle in cycles:
            version = _receipt_metadata_version(client, model.name, cycle.receipt_id)
            browser.get(links.model_version_url(mlflow.url, model.name, version))
            page_shows(browser, ["verdict", verdicts[cycle.key], cycle.receipt_id])
            _screenshot(browser, f"mlflow-version-cycle-{cycle.number}.png")
        browser.get(f"{mlflow.url}/#/models/{quote(model.name)}?workflowType=machine_learning")
        page_shows(browser, [model.name, "approved-default"])
        _screenshot(browser, "mlflow-model.png")
    finally:
        mlflow.stop()


def _receipt_metadata_version(client, model_name: str, receipt_id: str) -> str:
    """The model version MLflow tags with `receipt_id`."""
    (version,) = client.search_model_versions(f"name='{model_name}' and tags.receipt_id='{receipt_id}'")
    return version.version
