"""`lightning-dagster registry show | history | approve | promote | rollback | drill`.

Exit status: 0 done, 1 refused (not authorized, conflict, stale, unavailable), 2 bad input."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_dagster.registry.core import DEFAULT_APPROVER, DEFAULT_MODEL_NAME
from lightning_dagster.registry.lineage import model_uri


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="registry_command", metavar="COMMAND")

    def command(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or SQLite)")
        p.add_argument("--store-url", help="store URL (default: $LD_STORE_URL or SQLite)")
        p.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(handler=lambda args: _run(handler, args))
        return p

    command("show", "both pointers and the registered versions", _show)
    command("history", "the append-only history of approved-default", _history)
    p = command("approve", "record an approval as a new receipt version", _approve)
    p.add_argument("receipt", help="receipt id in the ledger, or a receipt JSON file")
    p.add_argument("--actor", required=True)
    p.add_argument("--role", required=True)
    p = command("promote", "move approved-default from the receipt's parent to its candidate", _promote)
    p.add_argument("receipt", help="receipt id in the ledger, or a receipt JSON file")
    p.add_argument("--actor", required=True)
    p.add_argument("--fingerprints", help="JSON file of current fingerprints (voids stale checks)")
    p.add_argument("--policy", help="gate policy file (default: the packaged policy)")
    p = command("rollback", "move approved-default back to a version it held before", _rollback)
    p.add_argument("version")
    p.add_argument("--actor", required=True)
    p.add_argument("--role", default=DEFAULT_APPROVER, help="the role the actor acts in")
    p = command(
        "drill", "rollback drill: resolve, verify, load and serve a version; pointer untouched", _drill
    )
    p.add_argument("version")


def _registry(args: argparse.Namespace):
    from lightning_dagster.registry.core import Registry
    from lightning_dagster.store import Store

    return Registry(args.tracking_uri, Store(args.store_url), args.model_name)


def _receipt_arg(value: str) -> Any:
    """A path to a JSON file is read; anything else is a ledger id."""
    from pathlib import Path

    from lightning_dagster.gate.receipt import read_json

    return read_json(value, "receipt") if value.endswith(".json") or Path(value).is_file() else value


def _run(handler, args: argparse.Namespace) -> int:
    from lightning_dagster.registry.errors import PointerConflict, RegistryError

    try:
        data, text, *status = handler(args)
    except (RegistryError, PointerConflict) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:
        print(f"invalid input: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2, default=str) if args.json else text)
    return status[0] if status else 0


def _move_row(m) -> dict[str, Any]:
    from lightning_dagster.registry.pointers import move_dict

    return move_dict(m) | {"note": m.note}


def _show(args):
    data = _registry(args).show()
    lines = [
        f"model             {data['model']}  ({data['tracking_uri']})",
        f"approved-default  {data['approved-default'] or '(never set)'}",
        f"latest-candidate  {data['latest-candidate'] or '(none)'}",
        "",
        "version  kind            parent  weights_hash  snapshot",
    ]
    for v in data["versions"]:
        lines.append(
            f"{v['version']:>7}  {v['kind']:<14}  {v['parent_version'] or '-':>6}  {v['weights_hash'][:12]:<12}  {v['snapshot_key']}"
        )
    return data, "\n".join(lines)


def _history(args):
    """The moves, then the incidents marked with `!`; `--json` gives one timeline whose rows say their `kind`."""
    from lightning_dagster.registry.pointers import iso

    reg = _registry(args)
    history, found = reg.history(), reg.incidents()
    moves = [_move_row(m) for m in history]
    lines = ["seq  at                    from  to    actor       receipt"]
    lines += [
        f"{m['seq']:>3}  {m['at']}  {m['from'] or '-':>4}  {m['to']:>4}  {m['actor']:<10}  {m['receipt_id'] or ''}"
        for m in moves
    ]
    if found:
        lines += [
            "",
            "INCIDENTS: MLflow's alias moved outside the registry (the store's pointer above stands)",
        ]
        lines += [
            f"  !{i.number:>2}  {iso(i.detected_at)}  alias was {i.found_version or '(deleted)'}, "
            f"store {i.store_version or '(unset)'} (seq {i.store_seq or '-'})  "
            f"{'restored' if i.restored else f'NOT restored: {i.error}'}  moved by {i.moved_by}"
            + (f", after {iso(i.not_before)}" if i.not_before else "")
            for i in found
        ]
    timeline = [(m.moved_at, {"kind": "move", **row}) for m, row in zip(history, moves, strict=True)]
    timeline += [
        (i.detected_at, {"kind": "incident", "at": iso(i.detected_at), **i.to_dict()}) for i in found
    ]
    return [row for _, row in sorted(timeline, key=lambda item: item[0])], "\n".join(lines)


def _approve(args):
    stored = _registry(args).approve(_receipt_arg(args.receipt), args.actor, args.role)
    data = {
        "receipt_id": stored.receipt.receipt_id,
        "version": stored.version,
        "content_hash": stored.content_hash,
    }
    return (
        data,
        f"approved by {args.actor} as {args.role}: receipt {data['receipt_id']} version {stored.version}",
    )


def _promote(args):
    current = None
    if args.fingerprints:
        from lightning_dagster.gate.receipt import read_json

        current = read_json(args.fingerprints, "fingerprints")
    result = _registry(args).promote(
        _receipt_arg(args.receipt), args.actor, policy=args.policy, current_fingerprints=current
    )
    data = {**_move_row(result.move), "mirrored": result.mirrored, "mirror_error": result.mirror_error}
    text = (
        f"approved-default {data['from']} -> {data['to']} by {data['actor']} (receipt {data['receipt_id']})"
    )
    if not result.mirrored:
        text += (
            f"\nwarning: MLflow mirror not yet updated ({result.mirror_error}); the next operation repairs it"
        )
    return data, text


def _rollback(args):
    result = _registry(args).rollback(args.version, args.actor, role=args.role)
    data = {**_move_row(result.move), "mirrored": result.mirrored, "mirror_error": result.mirror_error}
    return data, f"approved-default rolled back {data['from']} -> {data['to']} by {data['actor']}"


def _drill(args):
    reg = _registry(args)
    result = reg.rollback_drill(args.version)
    # What check 7 will read: a step MLflow's outage kept the drill from reaching is unavailable, not false.
    evidence = result.to_receipt_drill(model_uri(reg.model_name, result.version))
    data = result.to_dict() | {"receipt_drill": evidence.model_dump(mode="json")}
    steps = {"resolved": evidence.resolved, "loaded": evidence.loaded, "routed_back": evidence.routed_back}
    shown = " ".join(f"{k}={'unavailable' if v is None else v}" for k, v in steps.items())
    text = f"version {result.version}: {shown} ({result.seconds} s)" + (
        f"\nerror: {result.error}" if result.error else ""
    )
    return data, text, 0 if result.ok else 1
