"""`lightning-dagster gateway serve|key`: run the gateway in the foreground, or print an attempt key.

The admin key and the key-signing secret come from `LD_ADMIN_KEY` / `LD_GATEWAY_SECRET`; when absent they
are generated and printed once on stdout (never logged). Serve keys: `LD_SERVE_KEYS` (comma-separated).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import time

from lightning_dagster.gateway.keys import attempt_key


def _from_env(name: str, what: str) -> str:
    value = os.environ.get(name)
    if not value:
        value = secrets.token_hex(32)  # hex: never starts with "-", which argparse would read as a flag
        print(f"{name} was not set; generated {what}: {value}", flush=True)
    return value


def serve(args: argparse.Namespace) -> int:
    from lightning_dagster.gateway.local import LocalGateway
    from lightning_dagster.store import Store

    stopping = threading.Event()
    # Ctrl-C, a SIGTERM from whoever started us, or `_exit_with_parent`: stop serving and shut down cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    gateway = LocalGateway(
        Store(args.store),
        args.model,
        serving="thread",
        upstream_url=args.upstream,
        upstream_model=args.upstream_model,
        upstream_api_key=os.environ.get("LD_UPSTREAM_API_KEY", ""),
        host=args.host,
        port=args.port,
        secret=_from_env("LD_GATEWAY_SECRET", "a key-signing secret"),
        admin_key=_from_env("LD_ADMIN_KEY", "an admin key"),
        max_batch=args.max_batch,
        threads=args.threads,
        resource_id=args.resource_id,
        serve_keys=[k for k in os.environ.get("LD_SERVE_KEYS", "").split(",") if k],
        max_body_bytes=args.max_body_bytes,
        write_behind_ms=args.write_behind_ms,
        fsync_spans=args.fsync_spans,
    )
    with gateway:
        print(f"gateway on {gateway.url}/v1 ({gateway.backend_kind})", flush=True)
        if args.exit_with_parent:
            _exit_with_parent()
        stopping.wait()
    return 0


def _exit_with_parent() -> None:
    """A gateway started by a trainer must not outlive it (a killed trainer would leave it serving): once
    this process is re-parented, stop as on Ctrl-C, and hard after a grace period."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def key(args: argparse.Namespace) -> int:
    secret = os.environ.get("LD_GATEWAY_SECRET")
    if not secret:
        print("LD_GATEWAY_SECRET is not set", file=sys.stderr)
        return 2
    print(attempt_key(secret, args.rollout, args.attempt))
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gateway_command", metavar="COMMAND")
    p = sub.add_parser("serve", help="serve the OpenAI-compatible gateway")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face causal LM directory served by the embedded engine")
    source.add_argument("--upstream", help="base URL of an OpenAI-compatible server (e.g. vLLM)")
    p.add_argument("--upstream-model", default=None, help="model name to send upstream")
    p.add_argument("--resource-id", default=None, help="resource id recorded on spans")
    p.add_argument("--store", default=None, help="store URL (default: $LD_STORE_URL or the embedded SQLite)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the engine")
    p.add_argument("--max-batch", type=int, default=64, help="rows the engine samples at once")
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started this one exits"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument(
        "--write-behind-ms",
        type=float,
        default=0.0,
        help="acknowledge LLM calls before their span commits, batching spans for up to this long (0: durable)",
    )
    p.add_argument(
        "--fsync-spans",
        action="store_true",
        help="flush each LLM span to disk before responding (default: committed, flushed with the next reward)",
    )
    p.set_defaults(handler=serve)
    k = sub.add_parser("key", help="print the attempt key for a rollout attempt (needs LD_GATEWAY_SECRET)")
    k.add_argument("--rollout", required=True)
    k.add_argument("--attempt", required=True)
    k.set_defaults(handler=key)
