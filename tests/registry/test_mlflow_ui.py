"""The MLflow UI in headless Chromium, over a registry after a promotion: the UI links open the classic ML
view of the experiment with the training run in its runs table, and the registered model's versions show
the verdict, the receipt version and the approved flag. Screenshots are kept in the test's directory."""

from __future__ import annotations

import time

import pytest

from lightning_dagster.gate import PROMOTE, evaluate, load_policy
from lightning_dagster.gate.receipt import with_gate_record
from lightning_dagster.registry import Registry, links
from lightning_dagster.release import promotion
from lightning_dagster.store import Store
from tests.registry.helpers import approve, candidate_kwargs, passing_receipt
from tests.registry.mlflow_server import MlflowServer
from tests.support.browser import chromium, needs_chromium, page_shows

pytestmark = needs_chromium


@pytest.fixture
def browser(tmp_path):
    with chromium(tmp_path / "chromium-profile") as driver:
        yield driver


def test_mlflow_ui_opens_the_classic_ml_view_and_shows_the_verdict_on_the_version(
    tmp_path, variant, roles_file, approver_keys, browser
):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = Registry(
        uri,
        Store(f"sqlite:///{tmp_path / 'store.db'}"),
        "ui-policy",
        tmp_path / "artifacts",
        cache_dir=tmp_path / "cache",
        roles_file=roles_file,
    )
    parent = reg.register_initial_parent(variant(0))
    ended = time.time()
    cand = reg.log_candidate(
        variant(1), **candidate_kwargs(parent.version), started_at=ended - 161, ended_at=ended
    )
    receipt = passing_receipt(reg, parent, cand, "rec-ui", approver_keys)
    approve(
        reg,
        with_gate_record(receipt, evaluate(receipt, load_policy(None)).to_record()),
        approver_keys,
        "alice",
    )
    assert promotion.promote(reg, "rec-ui", "alice", key=approver_keys["alice"]).mirrored
    server = MlflowServer(uri, tmp_path / "served", tmp_path / "server.log").start()
    try:
        browser.get(links.experiment_url(server.url, reg.experiment_id))
        run_name = reg.client.get_run(cand.run_id).info.run_name
        body = page_shows(browser, [run_name, "initial-parent"])
        browser.save_screenshot(str(tmp_path / "experiment.png"))
        assert "workflowType=machine_learning" in browser.current_url and "/runs" in browser.current_url
        assert "Evaluation runs" not in body  # the GenAI view's navigation

        browser.get(links.run_url(server.url, reg.experiment_id, cand.run_id))
        page_shows(browser, [run_name, "2.7min"])  # 161 s of training, not the logging's fraction of a second
        browser.save_screenshot(str(tmp_path / "run.png"))

        browser.get(links.model_version_url(server.url, reg.model_name, cand.version))
        page_shows(browser, ["verdict", PROMOTE, "receipt_version", "approved_default", "true"])
        browser.save_screenshot(str(tmp_path / "version.png"))
    finally:
        server.stop()
        reg.store.close()
