"""`lightning-dagster loop status | history | sign | resume`: the continual-learning loop's pauses and the
signed resume of an authorized actor (the same decision the Dagster `resume` job records). Who may resume
is what the pause in force names (the deployment's default-approver roles when the sensor recorded it), read
from the store by both, so the command and the job give one answer for the same actor, role and key.

Exit status: 0 done, 1 refused (not paused, not authorized, no pinned roles), 2 bad input."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_dagster.settings import StoreSettings, add_flags, from_flags


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="loop_command", metavar="COMMAND")

    def command(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_flags(p, StoreSettings)
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(handler=lambda args: _run(handler, args))
        return p

    command("status", "paused or running, and the pause in force (conditions, receipt, since)", _status)
    p = command("history", "every pause and resume, oldest first", _history)
    p.add_argument("--last", type=_positive, default=50, help="only the newest N decisions (N >= 1)")
    for name, help_text, handler in (
        ("sign", "print a signed resume (the `resume` job's run config) without recording it", _sign),
        ("resume", "resume the paused loop: an authorized actor's signed decision, with a reason", _resume),
    ):
        p = command(name, help_text, handler)
        p.add_argument("--actor", required=True)
        p.add_argument("--key", required=True, help="the actor's private key file")
        p.add_argument("--reason", required=True, help="why the loop may learn again")
        p.add_argument(
            "--role",
            help="the role the actor acts in, one the pause names (default: the first; see `loop status`)",
        )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _store(args: argparse.Namespace):
    from lightning_dagster.store import Store

    return Store(from_flags(StoreSettings(), args).resolved_url())


def _status(args: argparse.Namespace) -> tuple[Any, str]:
    from lightning_dagster.pipeline.loop_history import describe, history, pause_roles

    past = history(_store(args))
    last = past[-1] if past else None
    if last is None or last.decision.action == "resume":
        data = {"state": "running", "last": last.decision.model_dump(mode="json") if last else None}
        text = "running" + (f" ({describe(last.decision)})" if last else " (never paused)")
        return data, text
    roles = pause_roles(last)
    pause = last.decision.model_dump(mode="json")
    data = {"state": "paused", "pause_hash": last.hash, "pause": pause, "resume_roles": roles}
    may = ", ".join(roles) or "(no role)"
    return data, f"paused: {describe(last.decision)}\npause {last.hash}\nmay resume: {may}"


def _history(args: argparse.Namespace) -> tuple[Any, str]:
    from lightning_dagster.pipeline.loop_history import history_table

    table = history_table(_store(args), last=args.last)
    data = [dict(zip(table.columns, row, strict=True)) for row in table.rows]
    text = "\n".join("  ".join("" if c is None else str(c) for c in row) for row in table.rows)
    return data, text or "no pause or resume recorded"


def _signed(args: argparse.Namespace, store):
    from lightning_dagster.pipeline.loop_history import sign_resume

    return sign_resume(store, actor=args.actor, role=args.role, key=args.key, reason=args.reason)


def _sign(args: argparse.Namespace) -> tuple[Any, str]:
    request = _signed(args, _store(args))
    data = request.model_dump(mode="json")
    return data, json.dumps(data, indent=2)


def _resume(args: argparse.Namespace) -> tuple[Any, str]:
    from lightning_dagster.pipeline.loop_history import describe, resume
    from lightning_dagster.release.roles import deployment_roles
    from lightning_dagster.settings import gate_from_env

    store = _store(args)
    request = _signed(args, store)
    # the deployment's roles as configured ($LD_ROLES_FILE, $LD_ROLES_ADMIN_KEY), the pin verified against them
    recorded = resume(store, request, actors=deployment_roles(store, gate=gate_from_env()).actors)
    text = f"{describe(recorded.decision)} (decision {recorded.version})"
    return recorded.decision.model_dump(mode="json"), text


def _run(handler, args: argparse.Namespace) -> int:
    from lightning_dagster.pipeline.loop_history import ResumeRefused, TamperedHistory
    from lightning_dagster.registry.errors import ChainBroken
    from lightning_dagster.release.errors import RolesConfigError

    try:
        data, text = handler(args)
    except (ResumeRefused, RolesConfigError, ChainBroken) as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    except TamperedHistory as exc:
        print(f"error: the loop's history does not verify: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a blank, oversized or control-character field, named by the gate
        print(f"invalid input: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if args.json else text)
    return 0
