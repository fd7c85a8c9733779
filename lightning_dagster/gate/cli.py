"""`lightning-dagster gate evaluate | verify | export`.

`evaluate RECEIPT` judges a receipt file under a policy, and its attestation against the pipeline key (the
flag, else $LD_PIPELINE_PUBLIC_KEY, else the public half of $LD_PIPELINE_KEY). Exit status: 0 `PROMOTE TO
BOUNDED CANARY`, 1 `HOLD`, 2 invalid input (one line naming the field; unreadable, oversized or too deeply
nested files too), 3 `UNATTESTED` (no attestation, one that does not verify, or no key to verify it with).
`verify RECEIPT_ID` re-checks a stored receipt's hash chain, attestations, and head against MLflow's receipt
tags or `--head`; a break is recorded once as a receipt incident, and the receipt's incidents are listed.
Exit status: 0 intact and confirmed, 1 tampered or unconfirmed, 2 no such receipt or an unreadable store.
`export RECEIPT_ID` prints a stored version as a receipt file carrying its attestation."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from lightning_dagster.gate import attestation
from lightning_dagster.gate.checks import HOLD, PROMOTE, UNATTESTED, Evaluation, evaluate
from lightning_dagster.gate.consistency import CLOCK_SKEW_S, KnownActors
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.ledger import file_problem
from lightning_dagster.gate.policy import Policy, load_policy
from lightning_dagster.gate.receipt import parse_receipt, read_json
from lightning_dagster.release.signing import parse_public_key
from lightning_dagster.settings import (
    GateSettings,
    MLflowSettings,
    StoreSettings,
    add_flags,
    dest_of,
    from_flags,
)

EXIT = {PROMOTE: 0, HOLD: 1, UNATTESTED: 3}


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
    add_flags(ev, GateSettings, ["policy_path", "roles_path", "pipeline_public_key"])
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
    ve = sub.add_parser(
        "verify",
        help="re-check a stored receipt: hash chain, attestations, the head against MLflow's receipt tags",
    )
    ve.add_argument("receipt_id")
    add_flags(ve, StoreSettings)
    add_flags(ve, MLflowSettings, ["tracking_uri", "model_name"])
    add_flags(ve, GateSettings, ["pipeline_public_key"])
    ve.add_argument("--head", help="the head hash recorded elsewhere (e.g. with a pointer move)")
    ve.set_defaults(handler=_verify)
    ex = sub.add_parser("export", help="print a stored receipt version as a file carrying its attestation")
    ex.add_argument("receipt_id")
    ex.add_argument("--version", type=int, help="the ledger version (default: the head)")
    add_flags(ex, StoreSettings)
    ex.set_defaults(handler=_export)


def _evaluate(args: argparse.Namespace) -> int:
    gate = from_flags(GateSettings(), args)
    policy = _policy(gate.policy_path or None)
    current = read_json(args.fingerprints, "fingerprints") if args.fingerprints else None
    if current is not None and not isinstance(current, dict):
        raise InvalidInput("fingerprints", [("", "expected a JSON object")])
    result = judge(
        read_json(args.receipt, "receipt"),
        policy,
        pipeline_public_key(gate),
        current,
        roles=_roles(gate.roles_path or None),
        clock_skew_s=args.clock_skew,
    )
    print(json.dumps(result.to_json_dict(), indent=2) if args.json else render(result))
    return EXIT[result.verdict]


def judge(data: Any, policy: Policy, public_key: str | None, *args: Any, **kwargs: Any) -> Evaluation:
    """`evaluate` a receipt file's JSON, `UNATTESTED` unless its attestation verifies with `public_key`."""
    body, att = attestation.split_file(data)
    receipt = parse_receipt(body)
    result = evaluate(receipt, policy, *args, **kwargs)
    if public_key is None:
        why = "no pipeline public key to verify its attestation with (--pipeline-public-key, $LD_PIPELINE_PUBLIC_KEY)"
    else:
        why = file_problem(receipt, att, public_key)
    return result if why is None else result.unattested(why)


def pipeline_public_key(gate: GateSettings) -> str | None:
    """The setting, else $LD_PIPELINE_PUBLIC_KEY, else the public half of $LD_PIPELINE_KEY (None: none)."""
    text = gate.pipeline_public_key.strip() or os.environ.get("LD_PIPELINE_PUBLIC_KEY", "").strip()
    if not text and os.environ.get("LD_PIPELINE_KEY"):
        # loading a private key file pulls in the release's errors (and the registry): only when needed
        from lightning_dagster.release.errors import KeyFileError
        from lightning_dagster.release.pipeline_key import public_key

        try:
            return public_key(GateSettings(pipeline_key_path=os.environ["LD_PIPELINE_KEY"]))
        except KeyFileError as err:
            raise InvalidInput("pipeline_public_key", [("", str(err))]) from None
    if not text:
        return None
    try:
        parse_public_key(text)
    except ValueError as err:
        raise InvalidInput("pipeline_public_key", [("", str(err))]) from None
    return text


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
    public = pipeline_public_key(from_flags(GateSettings(), args))
    try:
        ledger = ReceiptLedger(store := Store(url or None), attestation.PipelineKeys(public=public))
        report = ledger.verify_chain(args.receipt_id, expected_head=args.head)
    except (SQLAlchemyError, OSError, ValueError, RecursionError) as err:
        # one line: the first line of the driver's message names the cause ("file is not a database")
        print(f"error: cannot read the store {url or '(default)'}: {_first_line(err)}", file=sys.stderr)
        return 2
    if report.versions == 0:
        print(f"error: no receipt {args.receipt_id!r} in the ledger", file=sys.stderr)
        return 2
    confirmed = (["--head"] if args.head else []) + (["the attestation of every version"] if public else [])
    problem, mlflow, version = _mlflow_record(args, store, ledger)
    problems = report.problems + ([problem] if problem else [])
    confirmed += [mlflow] if version == report.versions and not problem else []
    print(f"receipt {report.receipt_id}: {report.versions} versions, head {report.head_hash}")
    checked = f"verified with {public}" if public else "not checked (no pipeline public key)"
    print(f"attestations: {checked}\nMLflow: {mlflow}")
    if not problems and not confirmed:
        problems = ["no independent record confirms the head: a rewrite that recomputes the chain's hashes "
                    "would pass (give --pipeline-public-key or --head, or reach MLflow)"]  # fmt: skip
    print("chain intact" if not problems else "TAMPERED:\n" + "\n".join(f"  - {p}" for p in problems))
    # A key given on the command line that is not the deployment's says nothing about the store: its
    # attestations failing against it is the caller's finding, not an incident.
    given = getattr(args, dest_of(GateSettings, "pipeline_public_key"), "")
    record = not given or public == pipeline_public_key(GateSettings())
    _incidents(ledger, report, record)
    return 0 if not problems else 1


def _incidents(ledger, report, record: bool) -> None:
    """Record the chain's break (once) when `record`, then list every receipt incident of the receipt."""
    from lightning_dagster.gate.receipt_incidents import incidents

    recorded = None
    try:
        recorded = ledger.record_break(report, "gate verify") if record else None
    except Exception as err:  # noqa: BLE001 - the verdict stands; say why it has no record
        print(f"receipt incident: the break could not be recorded: {_first_line(err)}")
    if recorded is not None:
        incident, new = recorded
        when = "recorded now" if new else "recorded before"
        print(f"receipt incident {incident.number} ({when}): {incident.problem}")
    try:
        known = incidents(ledger.store, report.receipt_id)
    except Exception as err:  # noqa: BLE001 - the verdict stands
        print(f"receipt incidents: cannot be listed: {_first_line(err)}")
        return
    if known:
        print(f"receipt incidents of {report.receipt_id}:")
        print("\n".join(f"  - {i.summary()}" for i in known))


def _mlflow_record(args: argparse.Namespace, store, ledger) -> tuple[str | None, str, int]:
    """`receipt_tags.compare` for the candidate's version, when the head names one."""
    try:
        candidate = ledger.head(args.receipt_id, verify=False).candidate
    except ValueError:
        return None, "not consulted (the head does not parse)", 0
    if candidate is None or candidate.model_version is None:
        return None, "not consulted (no candidate version recorded yet)", 0
    # MLflow's receipt tags, through the release (which reads the registry): only when a version is named
    from lightning_dagster.release.receipts import mlflow_record

    ml = from_flags(MLflowSettings(), args)
    return mlflow_record(store, ml.resolved_uri(), ml.model_name, args.receipt_id, candidate.model_version)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _export(args: argparse.Namespace) -> int:
    from lightning_dagster.gate.ledger import ReceiptLedger
    from lightning_dagster.store import Store

    url = from_flags(StoreSettings(), args).url
    print(json.dumps(ReceiptLedger(Store(url or None)).export(args.receipt_id, args.version), indent=1))
    return 0


def render(ev: Evaluation) -> str:
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
