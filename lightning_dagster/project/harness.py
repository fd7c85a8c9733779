"""A project's harness as the runner's `HarnessSpec`: `python: module:function` is called in-process with
an `openai.OpenAI` client (a number it returns is posted as the reward); `agl: module:Class` runs in its
own process (its `run()` reads the process-wide AGL_* variables)."""

from __future__ import annotations

import atexit
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import httpx
from openai import OpenAI

from lightning_dagster.project.agl_launcher import post_reward, reward_value
from lightning_dagster.project.config import Project
from lightning_dagster.project.errors import ProjectError
from lightning_dagster.project.references import resolve_callable
from lightning_dagster.runner.harness_spec import HarnessSpec

AGL_LAUNCHER = "lightning_dagster.project.agl_launcher"
_STRIPES = 64
_HTTP: list[httpx.Client | None] = [None] * _STRIPES
_HTTP_LOCK = threading.Lock()


def http_client() -> httpx.Client:
    """This thread's connection pool, one of `_STRIPES`: a pool per episode costs most of its client CPU;
    one pool makes 64 workers each pay for all 64 connections (httpcore's lock; `benchmarks/`)."""
    stripe = threading.get_native_id() % _STRIPES
    client = _HTTP[stripe]
    if client is None:
        with _HTTP_LOCK:
            client = _HTTP[stripe]
            if client is None:
                limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
                client = _HTTP[stripe] = httpx.Client(limits=limits, timeout=60.0)
                # keep-alive sockets to gateways that stopped would otherwise be reported unclosed at exit
                atexit.register(client.close)
    return client


def _resolved(project: Project, key: str, ref: str | None) -> Callable[..., Any] | None:
    if ref is None:
        return None
    try:
        return resolve_callable(ref, project.root)
    except ValueError as err:  # the module changed since the project was loaded
        raise ProjectError(project.file, [(key, str(err))]) from None


def inprocess_entry(function: Callable[..., Any], ref: str, timeout_s: float) -> Callable[..., float | None]:
    """The runner's in-process entry point for `function(task, client)`; a returned number is posted."""

    def run_task(task: dict[str, Any], *, base_url: str, api_key: str, event_url: str) -> float | None:
        client = OpenAI(
            base_url=base_url, api_key=api_key, max_retries=1, timeout=timeout_s, http_client=http_client()
        )
        value = reward_value(function(task, client), ref)
        if value is not None:
            post_reward(event_url, api_key, value)
        return value

    return run_task


def _declared_tools(ref: str | None) -> list[dict[str, Any]]:
    if ref is None:
        return []
    return list(getattr(importlib.import_module(ref.partition(":")[0]), "TOOLS", []))


def harness_spec(project: Project) -> HarnessSpec:
    """The runner's spec for the project's harness; raises ProjectError if a reference no longer resolves."""
    harness = project.harness
    argv: tuple[str, ...] | None = None
    run_task = None
    if harness.command is not None:
        argv = harness.command
    elif harness.agl is not None:
        argv = (sys.executable, "-m", AGL_LAUNCHER, str(project.root), harness.agl)
    else:
        function = _resolved(project, "harness.python", harness.python)
        run_task = inprocess_entry(function, str(harness.python), project.training.attempt_timeout_s)
    return HarnessSpec(
        name=project.name,
        expected_span_families=harness.expected_spans,
        argv=argv,
        run_task=run_task,
        cwd=project.root,
        env_map=dict(harness.env_map),
        prepare=_resolved(project, "harness.prepare", harness.prepare),
        verify=_resolved(project, "harness.verify", harness.verify),
        judge=_resolved(project, "reward", project.reward),
        judge_name=project.reward,
        timeout_s=project.training.attempt_timeout_s,
        max_attempts=project.training.max_attempts,
        tools=_declared_tools(harness.python or harness.agl),
        model_names=harness.model_names,
        env_passthrough=harness.env_passthrough,
        max_output_bytes=harness.max_output_bytes,
    )
