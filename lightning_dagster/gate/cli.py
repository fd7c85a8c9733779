"""`lightning-dagster gate evaluate RECEIPT [--policy-path POLICY] [--roles-path ROLES] [--json]`: judge a
receipt under a policy. Exit status: 0 `PROMOTE TO BOUNDED CANARY`, 1 `HOLD`, 2 invalid input (one line naming the field:
unreadable, undecodable, too large or too deeply nested files included).

`lightning-dagster gate verify RECEIPT_ID [--store-url URL] [--head HASH]`: re-check a stored receipt's hash
chain. Exit status: 0 intact, 1 tampered, 2 no such receipt or a store that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from lightning_dagster.gate.checks import PROMOTE, Evaluation, evaluate
from lightning_dagster.gate.consistency import CLOCK_SKEW_S, KnownActors
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.policy import Policy, load_policy
from lightning_dagster.gate.receipt import load_receipt, read_json
from lightning_dagster.settings import GateSettings, StoreSettings, add_flags, from_flags


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gate_command", metavar="COMMAND")
    help_text = "run the seven checks on a receipt and print the verdict"
    ev = sub.add_parser(
        "evaluate",
        help=help_text,
        description=f"{help_text}. Every approval must be signed by an actor of --roles-path "
        "(`actors: {name: {roles: [...], key: ed25519:...}}`); without it no actor is known (no store holds "
        "pinned roles here) and any approval fails check 7.",
    )
    ev.add_argument("receipt", help="receipt JSON file")
    add_flags(ev, GateSettings, ["policy_path", "roles_path"])
    ev.add_argument("--fingerprints", help="JSON object of current fingerprints, to void stale checks")
    ev.add_argument(
        "--clock-skew",
        type=_seconds,
        default=CLOCK_SKEW_S,
        metavar="SECONDS",
        help=f"how far a recorded time may lie ahead of this machine's clock (default {CLOCK_SKEW_S:g})",
    )
    ev.add_argument("--json", action="store_true", help="print the evaluation as JSON")
    ev.set_defaults(handler=_evaluate)
    ve = sub.add_parser("verify", help="re-check the hash chain of a receipt stored in the ledger")
    ve.add_argument("receipt_id")
    add_flags(ve, StoreSettings)
    ve.add_argument("--head", help="the head hash recorded elsewhere (e.g. with a pointer move)")
    ve.set_defaults(handler=_verify)


def _evaluate(args: argparse.Namespace) -> int:
    gate = from_flags(GateSettings(), args)
    policy = _policy(gate.policy_path or None)
    receipt = load_receipt(args.receipt)
    current = read_json(args.fingerprints, "fingerprints") if args.fingerprints else None
    if current is not None and not isinstance(current, dict):
        raise InvalidInput("fingerprints", [("", "expected a JSON object")])
    roles = _roles(gate.roles_path or None)
    result = evaluate(receipt, policy, current, roles=roles, clock_skew_s=args.clock_skew)
    print(json.dumps(result.to_json_dict(), indent=2) if args.json else render(result))
    return 0 if result.verdict == PROMOTE else 1


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _policy(path: str | None) -> Policy:
    """`load_policy`, with a file that is not text or nests too deeply for the YAML parser as bad input."""
    try:
        return load_policy(path)
    except UnicodeDecodeError as err:
        raise InvalidInput("policy", [("", f"not UTF-8 text: byte {err.start} cannot be decoded")]) from None
    except RecursionError:
        raise InvalidInput("policy", [("", "nested too deeply")]) from None


def _roles(path: str | None) -> KnownActors:
    """The actors of a roles file, read as a promotion reads it; none without a file."""
    if path is None:
        return {}
    # The release's roles pull in the registry (MLflow): imported only when a roles file is given.
    from lightning_dagster.release.errors import RolesConfigError
    from lightning_dagster.release.roles import read_roles_file

    try:
        return read_roles_file(path).actors
    except RolesConfigError as err:
        raise InvalidInput("roles", [("", str(err))]) from None


def _verify(args: argparse.Namespace) -> int:
    # The store pulls in SQLAlchemy: imported here so that `gate evaluate` stays light.
    from sqlalchemy.exc import SQLAlchemyError

    from lightning_dagster.gate.ledger import ReceiptLedger
    from lightning_dagster.store import Store

    url = from_flags(StoreSettings(), args).url
    try:
        report = ReceiptLedger(Store(url or None)).verify_chain(args.receipt_id, expected_head=args.head)
    except (SQLAlchemyError, OSError, ValueError, RecursionError) as err:
        # one line: the first line of the driver's message names the cause ("file is not a database")
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: cannot read the store {url or '(default)'}: {cause}", file=sys.stderr)
        return 2
    if report.versions == 0:
        print(f"error: no receipt {args.receipt_id!r} in the ledger", file=sys.stderr)
        return 2
    print(f"receipt {report.receipt_id}: {report.versions} versions, head {report.head_hash}")
    print("chain intact" if report.ok else "TAMPERED:\n" + "\n".join(f"  - {p}" for p in report.problems))
    return 0 if report.ok else 1


def render(ev: Evaluation) -> str:
    """A readable table: one row per check, then the verdict and every reason to hold."""
    rows = [(str(c.id), c.title, c.status + (" (void)" if c.void else ""), c.reason) for c in ev.checks]
    widths = [max(len(r[i]) for r in [("#", "check", "status", ""), *rows]) for i in range(3)]
    lines = [
        f"receipt {ev.receipt_id}  {ev.receipt_hash}",
        f"policy  {ev.policy_version}  {ev.policy_hash}",
        "",
        f"{'#':<{widths[0]}}  {'check':<{widths[1]}}  {'status':<{widths[2]}}  reason",
    ]
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
    lines += ["", f"verdict: {ev.verdict}"]
    if ev.stale_checks:
        lines.append(f"stale checks: {', '.join(map(str, ev.stale_checks))}")
    lines += [f"stopped: {stage} did not run: {why}" for stage, why in ev.not_run.items()]
    lines += [f"  - {reason}" for reason in ev.hold_reasons]
    return "\n".join(lines)
