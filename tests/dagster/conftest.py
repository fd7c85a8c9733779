"""Fixtures for the Dagster code location: one bootstrapped embedded home per session (warm-started parent
registered as approved-default), tiny training settings, and helpers to build the pipeline resource."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_dagster.demo import QUICK_TRAINING
from lightning_dagster.orchestration.resources import (
    GateResource,
    MLflowResource,
    PipelineResource,
    TrainingResource,
    default_pipeline,
)

HERE = Path(__file__).resolve().parent
TINY_POLICY = HERE / "policy-tiny.yaml"
ACTORS = {"alice": "release-owner", "bob": "default-approver"}


def tiny_training(**overrides) -> TrainingResource:
    # A parent warm-started into the window (sampled success ~0.2-0.4 on a 32-task probe: ~275 SFT steps,
    # ~3.5 min): a parent that solves none, or a few percent (where 200 steps on 512 demonstrations left it),
    # gives every group of a step the same reward now and then, so RL has nothing to learn, the candidate
    # is the parent and check 1 holds it ("nothing was trained"), which these plumbing tests' verdicts would
    # hang on. A tiny learning rate: the update changes the weights (check 1) without flipping a greedy
    # protected case by chance (check 5's zero tolerance).
    settings = {
        "min_serve_rollouts": 3,
        "warm_start_max_steps": 320,
        "warm_start_demos": 2000,
        "warm_start_probe_tasks": 32,
        "learning_rate": 1e-6,
        "group_size": 16,
    }
    return TrainingResource(**{**QUICK_TRAINING, **settings, **overrides})


# The deployment's configuration the session's pipelines read: roles file, pipeline key, roles-admin key.
DEPLOYMENT = {
    "roles_path": "LD_ROLES_FILE",
    "pipeline_key_path": "LD_PIPELINE_KEY",
    "roles_admin_key": "LD_ROLES_ADMIN_KEY",
}


def pipeline_for(
    policy: Path | None = None, *, mlflow: MLflowResource | None = None, **gate
) -> PipelineResource:
    """The pipeline resource with tiny settings; env vars read now (tests run outside the UI)."""
    overrides = {"mlflow": mlflow} if mlflow is not None else {}
    return default_pipeline(
        deferred=False,
        training=tiny_training(),
        gate=GateResource(
            policy_path=str(policy or ""),
            **{field: os.environ[name] for field, name in DEPLOYMENT.items()},
            **gate,
        ),
        **overrides,
    )


def _deployment_keys() -> dict[str, str]:
    """The pipeline's key and the roles-admin's public key, kept with the approvers' in the session's home
    (as the demo keeps its own)."""
    from lightning_dagster.demo import keypair
    from lightning_dagster.demo.setup import PIPELINE_ACTOR, ROLES_ADMIN

    return {
        "LD_PIPELINE_KEY": str(keypair(PIPELINE_ACTOR) / f"{PIPELINE_ACTOR}.key"),
        "LD_ROLES_ADMIN_KEY": (keypair(ROLES_ADMIN) / f"{ROLES_ADMIN}.pub").read_text().strip(),
    }


@pytest.fixture(scope="session")
def embedded_home() -> Iterator[Path]:
    """A fresh LIGHTNING_DAGSTER_HOME and roles file (outside it) for the whole session; restored after."""
    from lightning_dagster.demo import write_approvers

    root = Path(tempfile.mkdtemp(prefix="ld-dagster-"))
    saved = {
        k: os.environ.get(k)
        for k in ("LIGHTNING_DAGSTER_HOME", *DEPLOYMENT.values(), "LD_STORE_URL", "MLFLOW_TRACKING_URI")
    }
    os.environ["LIGHTNING_DAGSTER_HOME"] = str(root / "home")
    # Each actor's key pair in the home (where the demo keeps its approvers'), public keys in the roles file.
    roles = write_approvers(root / "roles.yaml", {r: a for a, r in ACTORS.items()})
    os.environ["LD_ROLES_FILE"] = str(roles)
    os.environ.update(_deployment_keys())
    for k in ("LD_STORE_URL", "MLFLOW_TRACKING_URI"):
        os.environ.pop(k, None)
    try:
        yield root / "home"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def bootstrapped(embedded_home: Path) -> Path:
    """The embedded home with its first parent warm-started and approved (about a minute, once)."""
    from lightning_dagster.pipeline.bootstrap import bootstrap_parent

    meta = bootstrap_parent(pipeline_for()).metadata
    assert meta["approved_default"] == "1" and meta["bootstrapped"] is True
    return embedded_home


def pytest_collection_modifyitems(config, items):
    """Tests marked `moves_session_pointer` (they promote in the session's home; the two-cycle demo also
    rewrites its approvers file: `moves_session_pointer(rewrites_approvers=True)`) run after every other test
    of the session, which expect the bootstrapped parent as `approved-default` and the pinned approvers; the
    ones that rewrite the approvers run last of all."""

    def order(item) -> tuple[bool, bool]:
        marker = item.get_closest_marker("moves_session_pointer")
        return marker is not None, marker is not None and marker.kwargs.get("rewrites_approvers", False)

    items.sort(key=order)


@pytest.fixture(autouse=True)
def _session_home(request, monkeypatch):
    """Every Dagster test sees the session's home, whatever a session fixture of another directory set
    meanwhile (the registry tests' own home, set up when their first test runs, stays in the environment
    for the rest of the session)."""
    home = request.getfixturevalue("embedded_home")
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(home))
    monkeypatch.setenv("LD_ROLES_FILE", str(home.parent / "roles.yaml"))
    for name, value in _deployment_keys().items():
        monkeypatch.setenv(name, value)
    for k in ("LD_STORE_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)


def resume_loop(p) -> None:
    """Resume the continual-learning loop of `p`'s store if a test left it paused: bob's signed decision
    (the session's default approver), recorded in its history like any other."""
    from lightning_dagster.demo import approver_keys
    from lightning_dagster.pipeline import loop_history
    from lightning_dagster.pipeline.context import approvers

    store = p.get_store()
    if loop_history.current_pause(store) is None:
        return
    request = loop_history.sign_resume(
        store, actor="bob", role="default-approver", key=approver_keys() / "bob.key", reason="test cleanup"
    )
    loop_history.resume(store, request, actors=approvers(p))


@pytest.fixture
def leaves_loop_running():
    """For a test that pauses the session store's loop: resumed afterwards, so later tests find it running."""
    yield
    resume_loop(pipeline_for())


# What the demo sets in the environment (and its printed commands carry): restored after it, handed to tests.
DEMO_ENV = ("LIGHTNING_DAGSTER_HOME", "DAGSTER_HOME", "LD_ROLES_FILE", "LD_PROJECT", "LD_GATE_POLICY")


@pytest.fixture(scope="session")
def finished_demo(bootstrapped, tmp_path_factory):
    """The two-cycle demo, run once on the session's bootstrapped home with tiny settings and the test policy
    (its approvers the session's actors), in a Dagster home of its own: its cycles, printed lines, the
    warnings it raised, `approved-default` before it, and the environment its printed commands set. Tests
    using it move the session's pointer (`moves_session_pointer(rewrites_approvers=True)`)."""
    import warnings
    from types import SimpleNamespace

    from lightning_dagster.demo import run_demo
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.project.examples import example_file
    from lightning_dagster.registry.core import APPROVED

    with pytest.MonkeyPatch.context() as env:
        env.setenv("DAGSTER_HOME", str(tmp_path_factory.mktemp("demo") / "dagster_home"))
        env.setenv("LD_GATE_POLICY", str(TINY_POLICY))
        for name in ("LD_PROJECT", "LD_ROLES_FILE"):
            env.setenv(name, os.environ.get(name, ""))
        resume_loop(pipeline_for())  # the demo starts, as on a fresh home, with the loop running
        before = ctx.registry(pipeline_for()).current(APPROVED)
        lines: list[str] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # 8 tasks x 16 a step: a step whose rollouts all got the same reward leaves RL nothing to learn
            # (check 1 then holds a candidate equal to its parent), so a step draws more than the parent's
            # ~0.3 sampled success needs to make that vanishingly rare
            training = tiny_training(tasks_per_step=8)
            actors = {role: actor for actor, role in ACTORS.items()}
            cycles = run_demo(example_file("calc"), training, actors=actors, out=lines.append)
        demo_env = {name: os.environ[name] for name in DEMO_ENV if os.environ.get(name)}
    return SimpleNamespace(
        cycles=cycles, lines=lines, warnings=[str(w.message) for w in caught if issubclass(w.category, UserWarning)],
        before=before, env=demo_env,
    )  # fmt: skip
