"""Agent Lightning 1.0.2's own REST tests (`tests/server/test_endpoints.py` of its source distribution), run
from its Python 3.12 venv against our gateway: each test against a fresh server over a fresh SQLite store, as
each of its tests gets a cleared in-memory store. Left out: its two proxy tests, which patch agl-server's
upstream call inside its own process (no live server can honour that), and the two tests 1.0.2 added where
our contract differs on purpose (`DIFFERS`). The other 12 pass."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from lightning_dagster.gateway import GatewayKeys, GatewayOptions, GatewayServer, UpstreamBackend, create_app
from lightning_dagster.store import Store
from tests.agl.conftest import ADMIN, KEY, SECRET
from tests.support.agl_venv import Python312Missing, agl_rest_tests, ensure_agl_venv

# agl-server's upstream call, patched in-process (`monkeypatch.setattr("agentlightning.server.proxy...")`)
PATCH_AGL_SERVER = {"test_proxy_completion_endpoint", "test_proxy_error_triplet_preserves_status"}
DIFFERS = {
    "test_triplet_events_do_not_dedupe_without_valid_prompt_tokens": "a posted model_request whose token ids"
    " are not lists of integers is a 422 naming the field, never stored (agl-server stores it)",
    "test_proxy_rejects_non_object_json_body": "the 400 carries OpenAI's error shape, {error: {message}},"
    " not FastAPI's {detail}",
}


@pytest.fixture(scope="module")
def agl_suite(tmp_path_factory) -> tuple[str, Path, list[str]]:
    """(the venv's python, a folder laid out as its tests expect with our conftest, the test names)."""
    try:
        python, source = str(ensure_agl_venv()), agl_rest_tests()
    except Python312Missing as exc:
        pytest.skip(f"Agent Lightning 1.0.2 needs Python 3.12: {exc}")
    root = tmp_path_factory.mktemp("agl-rest")
    server = root / "tests" / "server"
    server.mkdir(parents=True)
    for init in (root / "tests" / "__init__.py", server / "__init__.py"):
        init.write_text("")
    shutil.copy(source, server / "test_endpoints.py")
    shutil.copy(Path(__file__).parent / "agl_side" / "rest_conftest.py", server / "conftest.py")
    tree = ast.parse(source.read_text())
    tests = {
        n.name: ast.unparse(n)
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    }
    assert all("monkeypatch.setattr('agentlightning.server" in tests[name] for name in PATCH_AGL_SERVER)
    return python, root, sorted(tests)


def run_one(python: str, root: Path, name: str, url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AGL_SERVER_KEY": KEY, "AGL_REST_URL": url}
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/server/test_endpoints.py::{name}"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_agent_lightnings_own_rest_tests_pass_against_the_gateway(agl_suite, tmp_path, stub):
    python, root, names = agl_suite
    failed = {}
    run = [n for n in names if n not in PATCH_AGL_SERVER and n not in DIFFERS]
    assert len(run) == 12 and PATCH_AGL_SERVER | set(DIFFERS) <= set(names)
    for name in run:
        store = Store(f"sqlite:///{tmp_path / f'{name}.db'}")
        backend = UpstreamBackend(stub.url, model="stub-model")
        app = create_app(
            store, backend, keys=GatewayKeys(SECRET, ADMIN, agl_key=KEY), options=GatewayOptions()
        )
        try:
            with GatewayServer(app) as server:
                httpx.get(f"{server.url}/healthz").raise_for_status()
                done = run_one(python, root, name, server.url)
        finally:
            store.close()
        if done.returncode != 0:
            failed[name] = done.stdout[-1500:]
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
