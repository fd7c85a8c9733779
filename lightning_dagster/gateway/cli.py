"""`lightning-dagster gateway serve|key`: run the gateway in the foreground, or print an attempt key.

The key-signing secret and the admin key never come from the environment or the command line (any process
of the user reads those in /proc): `--secret-file` / `--admin-key-file` (mode 0600), or `--secrets-stdin`
(one JSON object, as a trainer passes them to its gateway child); when absent they are generated and printed
once on stdout (never logged). `LD_GATEWAY_SECRET` or `LD_ADMIN_KEY` set in the environment is refused
(exit 2). Serve keys and the upstream API key: `--secrets-stdin`, else `LD_SERVE_KEYS` (comma-separated) and
`LD_UPSTREAM_API_KEY`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
import time

from lightning_dagster.gateway.keys import SecretError, attempt_key, read_secret_file, refuse_env_secrets

# What `--secrets-stdin` reads: every name optional; serve keys a list of strings, the others strings.
STDIN_SECRETS = ("secret", "admin_key", "serve_keys", "upstream_api_key", "agl_key")


class RemovedSecretOption(argparse.Action):
    """`--secret VALUE`: refused with the new way, without echoing the value (argparse would, for an unknown
    option)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(
            f"{option_string} is no longer accepted: a command line is readable by every process of this user "
            "(/proc/PID/cmdline); put the secret in a file only you can read (chmod 600) and pass "
            f"{option_string}-file PATH, or {option_string}-file - to read it from standard input"
        )


def add_removed_secret_option(parser: argparse.ArgumentParser, option: str = "--secret") -> None:
    parser.add_argument(option, nargs="?", action=RemovedSecretOption, help=argparse.SUPPRESS)


def secrets_from_json(line: str) -> dict:
    """The secrets `--secrets-stdin` reads: one JSON object with keys among `STDIN_SECRETS`, else
    `SecretError`."""
    try:
        given = json.loads(line)
    except ValueError as exc:
        raise SecretError(f"--secrets-stdin: standard input is not one JSON object: {exc}") from exc
    if not isinstance(given, dict) or set(given) - set(STDIN_SECRETS):
        raise SecretError(
            f"--secrets-stdin: expected a JSON object with keys among {', '.join(STDIN_SECRETS)}"
        )
    keys = given.get("serve_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise SecretError("--secrets-stdin: serve_keys must be a list of strings")
    if not all(
        isinstance(given.get(name, ""), str)
        for name in ("secret", "admin_key", "upstream_api_key", "agl_key")
    ):
        raise SecretError("--secrets-stdin: secret, admin_key, upstream_api_key and agl_key must be strings")
    return given


def _stdin_secrets() -> dict:
    """One line of standard input; stdin is then /dev/null, so the pipe is gone once read."""
    line = sys.stdin.readline()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, sys.stdin.fileno())
    os.close(devnull)
    return secrets_from_json(line)


def _generated(value: str | None, what: str) -> str:
    if not value:
        value = secrets.token_hex(32)  # hex: never starts with "-", which argparse would read as a flag
        print(f"no {what} given; generated one: {value}", flush=True)
    return value


def _serve_secrets(args: argparse.Namespace) -> dict:
    refuse_env_secrets()
    if args.secrets_stdin:
        if args.secret_file or args.admin_key_file or args.agl_key_file:
            raise SecretError(
                "--secrets-stdin and --secret-file/--admin-key-file/--agl-key-file do not go together"
            )
        given = _stdin_secrets()
    else:
        given = {
            "secret": read_secret_file(args.secret_file) if args.secret_file else None,
            "admin_key": read_secret_file(args.admin_key_file) if args.admin_key_file else None,
            "serve_keys": [k for k in os.environ.get("LD_SERVE_KEYS", "").split(",") if k],
            "upstream_api_key": os.environ.get("LD_UPSTREAM_API_KEY", ""),
            "agl_key": read_secret_file(args.agl_key_file) if args.agl_key_file else None,
        }
    return {
        "secret": _generated(given.get("secret"), "key-signing secret"),
        "admin_key": _generated(given.get("admin_key"), "admin key"),
        "serve_keys": given.get("serve_keys", []),
        "upstream_api_key": given.get("upstream_api_key", ""),
        "agl_key": given.get("agl_key") or None,
    }


def serve(args: argparse.Namespace) -> int:
    from lightning_dagster.engine.engine import DeviceUnavailable
    from lightning_dagster.gateway.local import LocalGateway
    from lightning_dagster.store import Store

    try:
        keys = _serve_secrets(args)
    except SecretError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.upstream:
        from lightning_dagster.gateway.upstreams import upstream_urls

        try:
            upstream_urls(args.upstream)
        except ValueError as err:
            print(f"error: --upstream: {err}", file=sys.stderr)
            return 2
    agl_key = keys.pop("agl_key")
    agl = None
    if agl_key:
        from lightning_dagster.gateway.agl import AglSettings
        from lightning_dagster.types import Sampling

        train, val = (
            Sampling(temperature=args.agl_train_temperature),
            Sampling(temperature=args.agl_val_temperature),
        )
        agl = AglSettings(agl_key, train=train, val=val)

    stopping = threading.Event()
    # Ctrl-C, a SIGTERM from whoever started us, or `_exit_with_parent`: stop serving and shut down cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        gateway = LocalGateway(
            Store(args.store),
            args.model or args.tokenizer,
            serving="thread",
            upstream_url=",".join(args.upstream) if args.upstream else None,
            upstream_model=args.upstream_model,
            host=args.host,
            port=args.port,
            max_batch=args.max_batch,
            threads=args.threads,
            engine_process=args.engine_process,
            device=args.device,
            resource_id=args.resource_id,
            **keys,
            max_body_bytes=args.max_body_bytes,
            write_behind_ms=args.write_behind_ms,
            fsync_spans=args.fsync_spans,
            model_roots=args.model_root,
            model_aliases=args.model_alias or ("policy",),
            agl=agl,
        )
    except DeviceUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with gateway:
        print(f"gateway on {gateway.url}/v1 ({gateway.backend_kind})", flush=True)
        if agl is not None:
            print(f"Agent Lightning server on {gateway.url} (/api, /proxy)", flush=True)
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
    try:
        refuse_env_secrets()
        secret = read_secret_file(args.secret_file)
    except SecretError as err:
        print(f"error: {err}", file=sys.stderr)
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
    source.add_argument("--upstream", action="append", metavar="URL",
                        help="base URL of an OpenAI-compatible server, e.g. vLLM (repeatable or comma-separated: "
                             "calls stick to one per rollout and fail over when it is down)")  # fmt: skip
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --upstream: the served model's tokenizer folder; prompts then go upstream as "
                        "exact token ids (token-in) through the completions API")  # fmt: skip
    p.add_argument("--upstream-model", default=None, help="model name to send upstream")
    p.add_argument("--resource-id", default=None, help="resource id recorded on spans")
    p.add_argument("--store", default=None, help="store URL (default: $LD_STORE_URL or the embedded SQLite)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the engine")
    p.add_argument("--device", default="auto",
                   help="where the embedded engine runs: auto (CUDA when present, bf16 autocast; else CPU), "
                        "cpu, cuda, cuda:N")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=64, help="rows the engine samples at once")
    p.add_argument("--engine-process", action="store_true",
                   help="run the embedded engine in a process of its own (its decode loop then does not share "
                        "an interpreter lock with the HTTP server and span writes)")  # fmt: skip
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started this one exits"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--model-alias", action="append", default=None, metavar="NAME",
                   help="a model name served besides the model's own (repeatable; default: policy)")  # fmt: skip
    p.add_argument("--model-root", action="append", default=None, metavar="DIR",
                   help="a directory POST /admin/weights may read (repeatable; default: the models directory)")  # fmt: skip
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
    p.add_argument(
        "--secret-file", help="file holding the attempt-key secret, mode 0600 (default: generated)"
    )
    p.add_argument("--admin-key-file", help="file holding the admin key, mode 0600 (default: generated)")
    p.add_argument(
        "--secrets-stdin",
        action="store_true",
        help="read one JSON object from standard input with any of: " + ", ".join(STDIN_SECRETS),
    )
    p.add_argument("--agl-key-file", help="file holding the Agent Lightning server key, mode 0600 (-: standard "
                   "input); serves agl-server's /api and /proxy routes behind it")  # fmt: skip
    p.add_argument("--agl-train-temperature", type=float, default=1.0,
                   help="sampling temperature of Agent Lightning train rollouts (default: 1.0)")  # fmt: skip
    p.add_argument("--agl-val-temperature", type=float, default=1.0,
                   help="sampling temperature of its val rollouts (default: 1.0, as our holdout evaluation)")  # fmt: skip
    add_removed_secret_option(p)
    add_removed_secret_option(p, "--agl-key")
    p.set_defaults(handler=serve)
    k = sub.add_parser("key", help="print the attempt key for a rollout attempt")
    k.add_argument("--rollout", required=True)
    k.add_argument("--attempt", required=True)
    k.add_argument(
        "--secret-file",
        required=True,
        help="file holding the gateway's secret, mode 0600 (-: standard input)",
    )
    add_removed_secret_option(k)
    k.set_defaults(handler=key)
