"""`lightning-dagster gateway serve|key`: run the gateway in the foreground, or print an attempt key.

How it serves: one flag per gateway option, or the options object on standard input. The secret and the
admin key never come from the environment or the command line (readable in /proc): `--secret-file` /
`--admin-key-file` (mode 0600) or `--secrets-stdin` (one JSON object); absent, they are generated into new
0600 files under <home>/secrets, whose paths (never the values) are printed. Serve keys and the upstream API
key: `--secrets-stdin`, else `LD_SERVE_KEYS` and `LD_UPSTREAM_API_KEY`.
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

from lightning_dagster import paths
from lightning_dagster.gateway.keys import (
    GatewayKeys,
    SecretError,
    attempt_key,
    read_secret_file,
    refuse_env_secrets,
    write_secret_file,
)
from lightning_dagster.gateway.options import (
    GatewayOptions,
    add_option_flags,
    flags_given,
    options_from_flags,
)
from lightning_dagster.settings import SettingsError, StoreSettings, add_flags

STDIN_SECRETS = ("secret", "admin_key", "serve_keys", "upstream_api_key", "agl_key")
STDIN_KEYS = (*STDIN_SECRETS, "store_url", "options")


class RemovedSecretOption(argparse.Action):
    """`--secret VALUE`: refused with the new way, without echoing the value (argparse would)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(
            f"{option_string} is no longer accepted: a command line is readable by every process of this user "
            "(/proc/PID/cmdline); put the secret in a file only you can read (chmod 600) and pass "
            f"{option_string}-file PATH, or {option_string}-file - to read it from standard input"
        )


def add_removed_secret_option(parser: argparse.ArgumentParser, option: str = "--secret") -> None:
    # its own dest, never set: `--secret` is no setting (`settings.ServingSettings.secret` is not a flag)
    dest = "removed_" + option.strip("-").replace("-", "_")
    parser.add_argument(option, nargs="?", action=RemovedSecretOption, dest=dest, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # fmt: skip


def secrets_from_json(line: str) -> dict:
    """What `--secrets-stdin` reads: one JSON object with keys among `STDIN_KEYS`, else `SecretError`."""
    try:
        given = json.loads(line)
    except ValueError as exc:
        raise SecretError(f"--secrets-stdin: standard input is not one JSON object: {exc}") from exc
    if not isinstance(given, dict) or set(given) - set(STDIN_KEYS):
        raise SecretError(f"--secrets-stdin: expected a JSON object with keys among {', '.join(STDIN_KEYS)}")
    keys = given.get("serve_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise SecretError("--secrets-stdin: serve_keys must be a list of strings")
    strings = ("secret", "admin_key", "upstream_api_key", "agl_key", "store_url")
    if not all(isinstance(given.get(name, ""), str) for name in strings):
        raise SecretError(f"--secrets-stdin: {', '.join(strings)} must be strings")
    if not isinstance(given.get("options", {}), dict):
        raise SecretError("--secrets-stdin: options must be an object (gateway options by name)")
    return given


def _stdin_secrets() -> dict:
    """One line of standard input; stdin is then /dev/null, so the pipe is gone once read."""
    line = sys.stdin.readline()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, sys.stdin.fileno())
    os.close(devnull)
    return secrets_from_json(line)


def _generated(value: str | None, what: str, name: str) -> str:
    """`value`, else a new one in a new 0600 file whose path is printed: the value never is (stdout may go
    to a log others read). Pass the file on with `--secret-file` (e.g. `rollouts run --gateway`)."""
    if not value:
        value = secrets.token_hex(32)  # hex: never starts with "-", which argparse would read as a flag
        path = write_secret_file(paths.home() / "secrets" / f"gateway-{os.getpid()}.{name}", value)
        print(f"no {what} given; generated one into {path} (mode 0600)", flush=True)
    return value


def _handed(args: argparse.Namespace) -> tuple[GatewayKeys, dict]:
    """The gateway's keys, and what else came on standard input (`store_url`, `options`)."""
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
            "agl_key": read_secret_file(args.agl_key_file) if args.agl_key_file else "",
        }
    keys = GatewayKeys(
        _generated(given.get("secret"), "key-signing secret", "secret"),
        _generated(given.get("admin_key"), "admin key", "admin-key"),
        serve_keys=tuple(given.get("serve_keys", ())),
        upstream_api_key=given.get("upstream_api_key", ""),
        agl_key=given.get("agl_key") or "",
    )
    return keys, {name: given[name] for name in ("store_url", "options") if name in given}


def _options(args: argparse.Namespace, handed: dict) -> GatewayOptions:
    """The options on standard input, else those of the command line's flags (the two do not mix)."""
    if "options" not in handed:
        return options_from_flags(args)
    if flags_given(args):
        raise SettingsError(
            f"gateway serve: options came on standard input; {', '.join(flags_given(args))} "
            "given on the command line too"
        )
    return GatewayOptions.parse(handed["options"], where="options")


def _check_upstream(urls: str) -> None:
    from lightning_dagster.gateway.upstreams import upstream_urls

    try:
        upstream_urls(urls)
    except ValueError as err:
        raise SettingsError(f"gateway serve: --upstream-url: {err}") from None


def serve(args: argparse.Namespace) -> int:
    from lightning_dagster.gateway.local import LocalGateway
    from lightning_dagster.store import Store

    try:
        keys, handed = _handed(args)
        options = _options(args, handed)
        if "store_url" in handed and hasattr(args, "store_url"):
            raise SettingsError("gateway serve: the store URL came on standard input and as --store-url")
        store = StoreSettings(url=handed.get("store_url") or getattr(args, "store_url", ""))
        if options.serving.upstream_url:
            _check_upstream(options.serving.upstream_url)
            if args.model:
                raise SettingsError("gateway serve: --model or --upstream-url (with --tokenizer), not both")
        elif args.tokenizer:
            raise SettingsError("gateway serve: --tokenizer goes with --upstream-url")
        elif not args.model:
            raise SettingsError("gateway serve: serve a --model DIR, or forward to --upstream-url URL")
    except ValueError as err:  # SecretError, SettingsError
        print(f"error: {err}", file=sys.stderr)
        return 2

    stopping = threading.Event()
    # Ctrl-C, a SIGTERM from whoever started us, or `_exit_with_parent`: stop serving and shut down cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    gateway = LocalGateway(
        Store(store.resolved_url()),
        args.model or args.tokenizer,
        options,
        keys=keys,
        resource_id=args.resource_id,
    )
    with gateway:
        serving = options.serving
        kind = "upstream" if serving.upstream_url else "vllm" if serving.engine == "vllm" else "engine"
        print(f"gateway on {gateway.url}/v1 ({kind})", flush=True)
        if keys.agl_key:
            print(f"Agent Lightning server on {gateway.url} (/api, /proxy)", flush=True)
        if args.exit_with_parent:
            _exit_with_parent()
        stopping.wait()
    return 0


def _exit_with_parent() -> None:
    """Once this process is re-parented (its trainer died), stop as on Ctrl-C, and hard after a grace."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def key(args: argparse.Namespace) -> int:
    refuse_env_secrets()
    print(attempt_key(read_secret_file(args.secret_file), args.rollout, args.attempt))
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gateway_command", metavar="COMMAND")
    p = sub.add_parser("serve", help="serve the OpenAI-compatible gateway")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="a Hugging Face causal LM directory served by the embedded engine")
    add_option_flags(p, source)
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="with --upstream-url: the served model's tokenizer folder; prompts then go upstream "
                        "as exact token ids (token-in) through the completions API")  # fmt: skip
    p.add_argument("--resource-id", default=None, help="resource id recorded on spans")
    add_flags(p, StoreSettings, ["url"], prefix="store")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one exits")  # fmt: skip
    p.add_argument(
        "--secret-file", help="file holding the attempt-key secret, mode 0600 (default: generated)"
    )
    p.add_argument("--admin-key-file", help="file holding the admin key, mode 0600 (default: generated)")
    p.add_argument("--secrets-stdin", action="store_true", help="read one JSON object from standard "
                   f"input with any of: {', '.join(STDIN_KEYS)} (options: the gateway's options by name, "
                   "instead of their flags)")  # fmt: skip
    p.add_argument("--agl-key-file", help="file holding the Agent Lightning server key, mode 0600 (-: standard "
                   "input); serves agl-server's /api and /proxy routes behind it")  # fmt: skip
    add_removed_secret_option(p)
    add_removed_secret_option(p, "--agl-key")
    p.set_defaults(handler=serve)
    k = sub.add_parser("key", help="print the attempt key for a rollout attempt")
    k.add_argument("--rollout", required=True)
    k.add_argument("--attempt", required=True)
    k.add_argument("--secret-file", required=True,
                   help="file holding the gateway's secret, mode 0600 (-: standard input)")  # fmt: skip
    add_removed_secret_option(k)
    k.set_defaults(handler=key)
