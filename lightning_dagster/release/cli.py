"""`lightning-dagster registry show | history | serving | keygen | roles | sign | approve | promote |
sign-promote | sign-rollback | rollback | anchor | drill`: the registry's command, living with the release
since most of it is the release's. Exit status: 0 done, 1 refused (not authorized, conflict, stale,
unavailable), 2 bad input."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_dagster.gate.errors import TamperedReceipt
from lightning_dagster.gate.ledger import use_keys
from lightning_dagster.gate.receipt import Approval, parse_receipt, read_json
from lightning_dagster.registry.core import Registry
from lightning_dagster.registry.errors import PointerConflict, RegistryError
from lightning_dagster.registry.lineage import model_uri
from lightning_dagster.registry.pointers import iso, move_dict
from lightning_dagster.release import receipts
from lightning_dagster.release.chain import anchor
from lightning_dagster.release.pipeline_key import keys
from lightning_dagster.release.promotion import DEFAULT_APPROVER, PromoteRequest, promote, sign_promotion
from lightning_dagster.release.receipts import sign_approval
from lightning_dagster.release.roles import pin_fields, pin_roles, pin_state, read_roles_file, verify_pin
from lightning_dagster.release.rollbacks import rollback, rollback_request, sign_rollback
from lightning_dagster.release.signing import ROLES_PIN, generate_keypair, load_private_key, sign
from lightning_dagster.settings import (
    GateSettings,
    MLflowSettings,
    StoreSettings,
    add_flags,
    from_flags,
    gate_from_env,
)
from lightning_dagster.store import Store


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="registry_command", metavar="COMMAND")

    def command(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_flags(p, MLflowSettings, ["tracking_uri", "model_name"])
        add_flags(p, StoreSettings)
        add_flags(p, GateSettings, ["pipeline_key_path", "pipeline_public_key"])
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(handler=lambda args: _run(handler, args))
        return p

    command("show", "both pointers and the registered versions", _show)
    command("history", "the append-only history of approved-default", _history)
    command(
        "serving",
        "the approved-default checkpoint to serve; refused while MLflow's alias disagrees",
        _serving,
    )
    keygen = sub.add_parser("keygen", help="make an approver's Ed25519 key pair")
    keygen.add_argument("--actor", required=True)
    keygen.add_argument("--out", required=True, help="directory for <actor>.key (0600) and <actor>.pub")
    keygen.add_argument("--role", action="append", default=[], help="role(s) for the printed roles entry")
    keygen.add_argument("--json", action="store_true", help="print JSON")
    keygen.set_defaults(handler=lambda args: _run(_keygen, args))
    p = command(
        "roles", "the approver roles pinned in the store; --pin FILE pins a deployment's roles", _roles
    )
    p.add_argument("--pin", metavar="FILE", help="roles file to pin (a change of the pin needs --key)")
    p.add_argument("--key", help="the roles-admin's private key (its public half: gate.roles_admin_key)")
    p = command("sign", "print a signed approval (JSON) without recording it", _sign)
    _approval_args(p)
    p = command("approve", "record a signed approval as a new receipt version", _approve)
    _approval_args(p, signed_file=True)
    p = command("promote", "move approved-default from the receipt's parent to its candidate", _promote)
    p.add_argument("receipt", help="receipt id in the ledger, or a receipt JSON file")
    p.add_argument("--actor", required=True, help="whose signed default-step approval authorizes the move")
    p.add_argument(
        "--key", help="sign and record that approval first, and sign the move, with this private key file"
    )
    p.add_argument("--signed", metavar="FILE", help="a signed promotion JSON file (from `sign-promote`)")
    p.add_argument("--role", help="the role it is signed in (default: the receipt's first default approver)")
    p.add_argument("--fingerprints", help="JSON file of current fingerprints (voids stale checks)")
    add_flags(p, GateSettings, ["policy_path"])
    p = command(
        "sign-promote",
        "print a signed promotion (JSON, the `promote` job's run config) without moving anything",
        _sign_promote,
    )
    p.add_argument("receipt", help="receipt id in the ledger")
    p.add_argument("--actor", required=True, help="the default approver whose approval the receipt holds")
    p.add_argument("--key", required=True, help="the actor's private key file")
    p = command(
        "sign-rollback",
        "print a signed rollback (JSON, the `rollback` job's run config) without moving anything",
        _sign_rollback,
    )
    _rollback_args(p, signed_file=False)
    p = command(
        "rollback", "move approved-default back to a version it held before (a signed decision)", _rollback
    )
    _rollback_args(p, signed_file=True)
    p = command(
        "anchor",
        "re-anchor approved-default at VERSION by the configured roles-admin's signed move (a home whose moves "
        "predate signing, or after a recorded break)",
        _anchor,
    )
    p.add_argument("version")
    p.add_argument(
        "--key", required=True, help="the roles-admin's private key (its public half: gate.roles_admin_key)"
    )
    p = command(
        "drill", "rollback drill: resolve, verify, load and serve a version; pointer untouched", _drill
    )
    p.add_argument("version")


def _approval_args(p: argparse.ArgumentParser, *, signed_file: bool = False) -> None:
    p.add_argument("receipt", help="receipt id in the ledger, or a receipt JSON file")
    p.add_argument("--actor", required=not signed_file)
    p.add_argument("--role", required=not signed_file)
    p.add_argument("--key", required=not signed_file, help="the actor's private key file")
    p.add_argument("--step", choices=["canary", "default"], help="default: the step the role approves")
    if signed_file:
        p.add_argument("--approval", help="a signed approval JSON file (from `registry sign`)")


def _rollback_args(p: argparse.ArgumentParser, *, signed_file: bool) -> None:
    p.add_argument("version", nargs="?" if signed_file else None, help="the version to roll back to")
    p.add_argument("--actor", required=not signed_file)
    p.add_argument("--key", required=not signed_file, help="the actor's private key file")
    p.add_argument("--reason", required=not signed_file, help="why approved-default goes back")
    p.add_argument(
        "--role", default=DEFAULT_APPROVER, help=f"the role the actor acts in (only {DEFAULT_APPROVER} may)"
    )
    if signed_file:
        p.add_argument("--signed", metavar="FILE", help="a signed rollback JSON file (from `sign-rollback`)")


def _registry(args: argparse.Namespace):
    mlflow, store = from_flags(MLflowSettings(), args), from_flags(StoreSettings(), args)
    # The deployment's anchors from its environment, as the code location reads them.
    gate = from_flags(gate_from_env(), args)
    reg = Registry(mlflow.resolved_uri(), Store(store.resolved_url()), mlflow.model_name, gate=gate)
    # the receipts this command writes are attested, and those it reads verified, with the pipeline key
    use_keys(reg.store, keys(gate))
    return reg


def _receipt_arg(value: str) -> Any:
    return read_json(value, "receipt") if value.endswith(".json") or Path(value).is_file() else value


def _run(handler, args: argparse.Namespace) -> int:
    try:
        data, text, *status = handler(args)
    except (RegistryError, PointerConflict, TamperedReceipt) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:
        print(f"invalid input: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2, default=str) if args.json else text)
    return status[0] if status else 0


def _move_row(m) -> dict[str, Any]:
    return move_dict(m) | {"note": m.note}


def _show(args):
    data = _registry(args).show()
    lines = [
        f"model             {data['model']}  ({data['tracking_uri']})",
        f"approved-default  {data['approved-default'] or '(never set)'}",
        f"history           {data['chain']}",
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
    reg = _registry(args)
    chain = reg.verified()  # records a break as an incident before the incidents are read
    history, found = chain.history, reg.incidents()
    # before the newest anchor (itself signed by the roles-admin), moves are vouched for, not verified
    moves = [
        _move_row(m) | {"verified": m in chain.moves and n >= chain.vouched - 1}
        for n, m in enumerate(history)
    ]
    lines = [
        "history verifies" if chain.problem is None else f"BROKEN: {chain.problem}",
        "seq  at                    from  to    actor       receipt",
    ]
    lines += [
        f"{m['seq']:>3}  {m['at']}  {m['from'] or '-':>4}  {m['to']:>4}  {m['actor']:<10}  {m['receipt_id'] or ''}"
        + (
            ""
            if m["verified"]
            else "  VOUCHED (before an anchor)"
            if n < chain.vouched - 1
            else "  UNVERIFIED"
        )
        for n, m in enumerate(moves)
    ]
    if found:
        lines += [
            "",
            "INCIDENTS: the history did not verify, or MLflow's mirror changed outside the registry",
        ]
        lines += [
            f"  !{i.number:>2}  {iso(i.detected_at)}  {i.summary()}"
            if i.chain
            else f"  !{i.number:>2}  {iso(i.detected_at)}  alias was {i.found_version or '(deleted)'}, "
            f"store {i.store_version or '(unset)'} (seq {i.store_seq or '-'})  "
            f"{'restored' if i.restored else f'NOT restored: {i.error}'}  moved by {i.moved_by}"
            + (f", after {iso(i.not_before)}" if i.not_before else "")
            + (f"; differed: {'; '.join(i.differences)}" if i.differences else "")
            for i in found
        ]
    timeline = [(m.moved_at, {"kind": "move", **row}) for m, row in zip(history, moves, strict=True)]
    timeline += [
        (i.detected_at, {"kind": "incident", "at": iso(i.detected_at), **i.to_dict()}) for i in found
    ]
    return [row for _, row in sorted(timeline, key=lambda item: item[0])], "\n".join(lines)


def _keygen(args):
    pair = generate_keypair(args.actor, args.out)
    data = {"actor": pair.actor, "private_key": str(pair.private_path), "public_key": pair.public_key}
    text = f"{pair.public_key}\n# private key: {pair.private_path} (keep it; never share it)"
    if args.role:
        text += "\n# roles file entry:\n" + pair.roles_entry(args.role)
    return data, text


def _roles(args):
    reg = _registry(args)
    if args.pin:
        roles, signature = read_roles_file(args.pin), None
        if args.key:
            previous, pin_seq = pin_state(reg.store)
            fields = pin_fields(previous, roles.digest, pin_seq=pin_seq)
            signature = sign(load_private_key(args.key), ROLES_PIN, fields)
        pin_roles(reg.store, roles, reg.gate, signature=signature)
    chain = verify_pin(reg.store, reg.gate, match_configured=not args.pin)
    roles = chain.versions[-1] if chain.versions else None
    if roles is None:
        return None, "no roles pinned (pin the deployment's with --pin FILE)" + (
            f"\nBROKEN: {chain.problem}" if chain.problem else ""
        )
    data = {"digest": roles.digest, "source": roles.source, "actors": roles.table(), "problem": chain.problem}
    lines = [f"roles {roles.digest} (from {roles.source})"]
    lines += [f"  {a}: {', '.join(sorted(k.roles))}  {k.public_key}" for a, k in sorted(roles.actors.items())]
    lines += [f"BROKEN: {chain.problem}"] if chain.problem else []
    return data, "\n".join(lines)


def _receipt_value(reg, value: Any):
    return receipts.load(reg.store, value).receipt if isinstance(value, str) else parse_receipt(value)


def _signed(reg, receipt_arg: Any, actor: str, role: str, key: str, step: str | None = None):
    return sign_approval(_receipt_value(reg, receipt_arg), actor=actor, role=role, key=key, step=step)


def _printed(signed) -> tuple[dict, str]:
    data = signed.model_dump(mode="json")
    return data, json.dumps(data, indent=2)


def _sign(args):
    reg = _registry(args)
    return _printed(_signed(reg, _receipt_arg(args.receipt), args.actor, args.role, args.key, args.step))


def _approve(args):
    reg, receipt = _registry(args), _receipt_arg(args.receipt)
    if args.approval:
        approval = Approval.model_validate(read_json(args.approval, "approval"))
    elif args.actor and args.role and args.key:
        approval = _signed(reg, receipt, args.actor, args.role, args.key, args.step)
    else:
        raise ValueError("give --approval FILE, or --actor, --role and --key to sign here")
    stored = receipts.approve(reg, receipt, approval)
    rid = stored.receipt.receipt_id
    data = {"receipt_id": rid, "version": stored.version, "content_hash": stored.content_hash}
    text = f"approved by {approval.actor} as {approval.role} ({approval.step}): receipt {rid} version {stored.version}"
    return data, text


def _promote(args):
    current = read_json(args.fingerprints, "fingerprints") if args.fingerprints else None
    reg, receipt = _registry(args), _receipt_arg(args.receipt)
    if args.key:
        role = args.role or _receipt_value(reg, receipt).plan.approvers.default[0]
        approval = _signed(reg, receipt, args.actor, role, args.key, "default")
        receipt = receipts.approve(reg, receipt, approval).receipt.receipt_id
    signed = PromoteRequest.model_validate(read_json(args.signed, "promotion")) if args.signed else None
    result = promote(
        reg, receipt, args.actor, signed=signed, key=args.key, policy=reg.gate.policy_path or None,
        current_fingerprints=current,
    )  # fmt: skip
    data = {**_move_row(result.move), "mirrored": result.mirrored, "mirror_error": result.mirror_error}
    text = (
        f"approved-default {data['from']} -> {data['to']} by {data['actor']} (receipt {data['receipt_id']})"
    )
    if not result.mirrored:
        text += (
            f"\nwarning: MLflow mirror not yet updated ({result.mirror_error}); the next operation repairs it"
        )
    return data, text


def _sign_promote(args):
    return _printed(sign_promotion(_registry(args), args.receipt, actor=args.actor, key=args.key))


def _signed_rollback(reg, args):
    return sign_rollback(
        reg, args.version, actor=args.actor, role=args.role, key=args.key, reason=args.reason
    )


def _sign_rollback(args):
    return _printed(_signed_rollback(_registry(args), args))


def _rollback(args):
    reg = _registry(args)
    if args.signed:
        request = rollback_request(read_json(args.signed, "rollback"))
        if args.version is not None and args.version != request.target_version:
            raise ValueError(
                f"{args.signed} signs a rollback to {request.target_version}, not {args.version}"
            )
    elif args.version and args.actor and args.key and args.reason:
        request = _signed_rollback(reg, args)
    else:
        raise ValueError("give VERSION with --actor, --key and --reason to sign here, or --signed FILE")
    result = rollback(reg, request)
    data = {**_move_row(result.move), "mirrored": result.mirrored, "mirror_error": result.mirror_error}
    return data, f"approved-default rolled back {data['from']} -> {data['to']} by {data['actor']}"


def _anchor(args):
    move = anchor(_registry(args), args.version, args.key)
    text = f"approved-default anchored at {move.to_value} (move {move.seq}) by the roles-admin"
    return _move_row(move), text


def _serving(args):
    resolved = _registry(args).serve_approved()
    data = {"version": resolved.version, "weights_hash": resolved.weights_hash,
            "local_path": str(resolved.local_path), "model_uri": resolved.model_uri}  # fmt: skip
    return data, f"approved-default {resolved.version}  {resolved.local_path}"


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
