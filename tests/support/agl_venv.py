"""Agent Lightning 1.0.2 in its own Python 3.12 virtual environment (`benchmarks/.work/agl-venv`), created on
first use; shared by `benchmarks/gateway_vs_agl.py` and the tests that drive our server with its client."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

AGL_VERSION = "1.0.2"
VENV = Path(__file__).resolve().parents[2] / "benchmarks" / ".work" / "agl-venv"


class Python312Missing(RuntimeError):
    """No Python 3.12 interpreter on this machine (Agent Lightning 1.0.2 needs >= 3.12)."""


def python312() -> str:
    """A Python 3.12 interpreter: pyenv's (`$(pyenv root)/versions/3.12.*`), else `python3.12` on PATH."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    if shutil.which("pyenv"):
        found = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        root = found.stdout.strip() or root
    candidates = sorted(glob.glob(f"{root}/versions/3.12.*/bin/python"), reverse=True)
    on_path = shutil.which("python3.12")
    for exe in [*candidates, *([on_path] if on_path else [])]:
        if subprocess.run([exe, "-c", "import venv"], capture_output=True).returncode == 0:
            return exe
    raise Python312Missing("Python 3.12 not found (pyenv versions/3.12.* or python3.12 on PATH)")


def ensure_agl_venv(venv: Path = VENV) -> Path:
    """The venv's interpreter, with agentlightning installed (created and installed on first use)."""
    python = venv / "bin" / "python"
    probe = [
        str(python),
        "-c",
        f"import agentlightning, importlib.metadata as m; assert m.version('agentlightning') == '{AGL_VERSION}'",
    ]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    subprocess.run([python312(), "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"agentlightning=={AGL_VERSION}"], check=True)
    return python


def agl_rest_tests(venv: Path = VENV) -> Path:
    """Agent Lightning 1.0.2's own REST tests (`tests/server/test_endpoints.py` of its source distribution,
    which its wheel leaves out), unpacked once beside its venv, with pytest installed in that venv to run
    them. Returns the unpacked file."""
    python = ensure_agl_venv(venv)
    target = venv.parent / f"agl-tests-{AGL_VERSION}" / "tests" / "server" / "test_endpoints.py"
    if not target.exists():
        sdists = venv.parent / "agl-sdist"
        pip = [
            str(python),
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(sdists),
        ]
        subprocess.run([*pip, f"agentlightning=={AGL_VERSION}"], check=True)
        with tarfile.open(sdists / f"agentlightning-{AGL_VERSION}.tar.gz") as tar:
            member = tar.getmember(f"agentlightning-{AGL_VERSION}/tests/server/test_endpoints.py")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    if subprocess.run([str(python), "-c", "import pytest"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "pytest"], check=True)
    return target
