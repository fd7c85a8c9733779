"""The gateway's secrets never sit in a process's environment or command line: files only their owner can
read, standard input, and clear refusals of the old ways."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lightning_dagster.cli import main
from lightning_dagster.gateway import GatewayKeys, gateway_options
from lightning_dagster.gateway.cli import secrets_from_json
from lightning_dagster.gateway.keys import SecretError, attempt_key, read_secret_file
from lightning_dagster.gateway.local import LocalGateway
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store
from tests.gateway.conftest import ADMIN, SECRET
from tests.support.secrets import free_port, secret_file, serve_upstream_cli, wait_healthy


def proc_text(pid: int, part: str) -> str:
    with open(f"/proc/{pid}/{part}", "rb") as fh:
        return fh.read().decode("utf-8", "replace")


def test_a_secret_file_only_its_owner_can_read_is_read_and_stripped(tmp_path):
    assert read_secret_file(secret_file(tmp_path, SECRET)) == SECRET


@pytest.mark.parametrize(
    ("mode", "content", "cause"),
    [
        (0o644, SECRET, "mode 0644: others may read it"),
        (0o640, SECRET, "mode 0640"),
        (0o600, " \n", "is empty"),
    ],
)
def test_a_secret_file_others_may_read_or_an_empty_one_is_refused(tmp_path, mode, content, cause):
    path = tmp_path / "secret"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(SecretError, match=cause):
        read_secret_file(path)


def test_a_symlink_a_directory_or_a_missing_secret_file_is_refused(tmp_path):
    target = secret_file(tmp_path, SECRET)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(SecretError, match="cannot open the secret file .*link"):
        read_secret_file(tmp_path / "link")
    with pytest.raises(SecretError, match="cannot open the secret file .*nope"):
        read_secret_file(tmp_path / "nope")
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(SecretError, match="not a regular file"):
        read_secret_file(tmp_path / "dir")


def test_gateway_key_reads_the_secret_from_a_file_or_stdin(tmp_path, capsys, monkeypatch):
    expected = attempt_key(SECRET, "ro-1", "at-1")
    argv = ["gateway", "key", "--rollout", "ro-1", "--attempt", "at-1", "--secret-file"]
    assert main(argv + [secret_file(tmp_path, SECRET)]) == 0
    assert capsys.readouterr().out.strip() == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO(SECRET + "\n"))
    assert main(argv + ["-"]) == 0
    assert capsys.readouterr().out.strip() == expected


@pytest.mark.parametrize("name", ["LD_GATEWAY_SECRET", "LD_ADMIN_KEY"])
@pytest.mark.parametrize(
    "argv",
    [
        ["gateway", "serve", "--upstream-url", "http://127.0.0.1:9", "--port", "0"],
        ["gateway", "key", "--rollout", "r", "--attempt", "a", "--secret-file", "-"],
        ["rollouts", "run", "--harness", "calc", "--n", "1", "--group-size", "1", "--gateway", "http://127.0.0.1:9"],
    ],
    ids=["serve", "key", "rollouts-run"],
)
def test_a_secret_in_the_environment_is_refused_before_anything_starts(argv, name, monkeypatch, capsys):
    monkeypatch.setenv(name, "env-secret-value")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{name} set in the environment" in err and "/proc/PID/environ" in err and "--secret-file" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["gateway", "serve", "--upstream-url", "http://127.0.0.1:9"],
        ["gateway", "key", "--rollout", "r", "--attempt", "a", "--secret-file", "-"],
        ["rollouts", "run", "--harness", "calc", "--n", "1", "--group-size", "1", "--gateway", "http://127.0.0.1:9"],
    ],
    ids=["serve", "key", "rollouts-run"],
)
def test_the_removed_secret_option_says_the_new_way_without_echoing_the_value(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--secret=argv-secret-value"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--secret is no longer accepted" in err and "--secret-file PATH" in err
    assert "argv-secret-value" not in err


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("not json\n", "not one JSON object"),
        ('{"secret": "s", "password": "p"}\n', "keys among secret, admin_key"),
        ('{"serve_keys": "k1,k2"}\n', "serve_keys must be a list of strings"),
        ('{"secret": 12}\n', "must be strings"),
    ],
)
def test_secrets_stdin_refuses_anything_but_one_json_object_of_known_secrets(given, message):
    with pytest.raises(SecretError, match=message):
        secrets_from_json(given)


def test_gateway_serve_with_secret_files_keeps_them_out_of_its_environ_and_cmdline(tmp_path, stub):
    proc, port = serve_upstream_cli(tmp_path, stub.url, SECRET, ADMIN)
    try:
        assert wait_healthy(proc, f"http://127.0.0.1:{port}", ADMIN).status_code == 200
        environ, cmdline = proc_text(proc.pid, "environ"), proc_text(proc.pid, "cmdline")
        # A key the file's secret signs is accepted; one another secret signs is not.
        accepted, refused = (
            httpx.get(
                f"http://127.0.0.1:{port}/v1/models",
                headers={"Authorization": f"Bearer {attempt_key(secret, 'ro-x', 'at-x')}"},
            ).status_code
            for secret in (SECRET, "another-secret")
        )
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert (accepted, refused) == (200, 401)
    for secret in (SECRET, ADMIN):
        assert secret not in environ and secret not in cmdline and secret not in out


def test_the_training_loops_gateway_child_gets_its_secrets_on_stdin_only(tmp_path, stub):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    options = gateway_options(ServingSettings(upstream_url=stub.url), model_names=["-agent-model"])
    keys = GatewayKeys.fresh(serve_keys=("serve-k",), upstream_api_key="up-k")
    with LocalGateway(store, None, options, keys=keys, child=True) as gw:
        child = gw._process
        environ, cmdline = proc_text(gw.pid, "environ"), proc_text(gw.pid, "cmdline")
        health = httpx.get(f"{gw.url}/admin/health", headers={"Authorization": f"Bearer {child.admin_key}"})
        serve = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer serve-k"})
        stdin_target = os.readlink(f"/proc/{gw.pid}/fd/0")
    store.close()
    assert health.status_code == 200 and serve.status_code == 200  # both arrived through the pipe
    # the options arrived whole on the same pipe (a name starting with "-" too): none is on the command line
    assert "-agent-model" in [m["id"] for m in serve.json()["data"]] and "-agent-model" not in cmdline
    assert stub.url not in cmdline
    for secret in (gw.secret, child.admin_key, "serve-k", "up-k", store.url):
        assert secret not in environ and secret not in cmdline
    assert "--secrets-stdin" in cmdline.split("\0")
    assert stdin_target == os.devnull  # the pipe the secrets came through is gone once read


def test_options_on_standard_input_and_option_flags_do_not_mix(tmp_path):
    handed = json.dumps(
        {"store_url": f"sqlite:///{tmp_path / 's.db'}", "options": {"serving": {"max_batch": 4}}}
    )
    served = subprocess.run(
        [sys.executable, "-m", "lightning_dagster.cli", "gateway", "serve", "--secrets-stdin",
         "--upstream-url", "http://127.0.0.1:9", "--max-batch", "2"],
        input=handed + "\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert served.returncode == 2, served.stderr[-2000:]
    err = served.stderr
    assert "options came on standard input; --upstream-url, --max-batch given on the command line too" in err


def test_the_pipeline_resources_refuse_a_gateway_secret_in_the_environment(monkeypatch):
    from lightning_dagster.orchestration.resources import default_pipeline

    assert default_pipeline().serving.secret == ""  # a fresh secret per run, held in memory
    monkeypatch.setenv("LD_GATEWAY_SECRET", "env-secret-value")
    with pytest.raises(SecretError, match="LD_GATEWAY_SECRET set in the environment"):
        default_pipeline()


def test_a_generated_secret_and_admin_key_go_to_0600_files_whose_paths_alone_are_printed(tmp_path, stub):
    port, home, log = free_port(), tmp_path / "home", tmp_path / "gateway.log"
    cmd = [sys.executable, "-m", "lightning_dagster.cli", "gateway", "serve", "--port", str(port)]
    cmd += ["--upstream-url", stub.url, "--store-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    env = {**os.environ, "LIGHTNING_DAGSTER_HOME": str(home)}
    with log.open("w") as out:  # its stdout is its log, as a service manager keeps it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count("generated one into") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        said = re.findall(r"no (key-signing secret|admin key) given; generated one into (\S+) \(mode 0600\)",
                          log.read_text())  # fmt: skip
        files = {what: Path(path) for what, path in said}
        assert set(files) == {"key-signing secret", "admin key"}
        for path in files.values():
            assert path.parent == home / "secrets" and stat.S_IMODE(path.stat().st_mode) == 0o600
        secret, admin = (read_secret_file(files[w]) for w in ("key-signing secret", "admin key"))
        assert wait_healthy(proc, f"http://127.0.0.1:{port}", admin).status_code == 200
        key = attempt_key(secret, "ro-x", "at-x")  # the file's secret is the one the gateway signs with
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    text = log.read_text()
    assert secret not in text and admin not in text
