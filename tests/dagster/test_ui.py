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

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
KEY = "snap-20261130T1000Z-0000ui01"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (shutil.which("chromium") and shutil.which("chromedriver")), reason="needs chromium"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(tmp_path: Path, **env_extra: str):
    """`dagster-webserver -w workspace.yaml` with a fresh DAGSTER_HOME (Dagster's default SQLite instance)."""
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    # No daemon in this test: the default coordinator launches a run straight from the UI instead of queueing
    # it for the daemon (dagster.yaml's QueuedRunCoordinator is for real deployments under `dagster dev`).
    (dagster_home / "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster.core.run_coordinator\n  class: DefaultRunCoordinator\n"
        "telemetry:\n  enabled: false\n"
    )
    instance = dg.DagsterInstance.from_config(str(dagster_home))
    instance.add_dynamic_partitions("snapshots", [KEY])
    port = _free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(dagster_home),
        "LIGHTNING_DAGSTER_HOME": str(tmp_path / "home"),
        **env_extra,
    }
    log = open(tmp_path / "webserver.log", "w")
    proc = subprocess.Popen(
        [
            str(Path(os.sys.executable).parent / "dagster-webserver"),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-w",
            "workspace.yaml",
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
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(
        options=opts, service=webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    )
    try:
        yield driver
    finally:
        driver.quit()


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


def _materialize_tasks_from_the_ui(browser, url: str, instance) -> dg.DagsterRun:
    """Launch the `tasks` asset of partition KEY from its page and wait for the run to finish."""
    browser.get(f"{url}/assets/tasks")
    _click(browser, "//button[starts-with(normalize-space(.), 'Materialize')]")
    _click(browser, "//*[contains(text(), 'Select a partition')]")
    _click(browser, f"//span[normalize-space(text())='{KEY}']")
    _click(browser, "//*[normalize-space(text())='Launch runs to materialize tasks']")  # close the picker
    _click(browser, "//button[starts-with(normalize-space(.), 'Launch')]")
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = instance.get_runs()
        if runs and runs[0].is_finished:
            break
        time.sleep(1)
    (run,) = instance.get_runs()
    return run


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
