"""Direct edits of the store (SQL, as whoever can write the store file or database would make them): every
reader of `approved-default` detects each one, a recorded incident names the first bad record (once, not
per read), serving refuses, and the pointer reads as its last verified move. On SQLite and PostgreSQL."""

from __future__ import annotations

import argparse
import json

import pytest
import sqlalchemy as sa

from lightning_dagster.registry import APPROVED
from lightning_dagster.registry.errors import ChainBroken
from lightning_dagster.release import promotion, rollbacks
from lightning_dagster.release.cli import register
from lightning_dagster.release.roles import COLLECTION, PIN, parse_roles, registry_roles
from lightning_dagster.release.signing import load_private_key, public_key_line
from tests.registry.helpers import bootstrap, signed_move


def _sql(store, *statements, unlock: tuple[str, ...] = ()):
    """Run `statements` in one transaction, the append-only triggers of the `unlock` tables out of the way."""
    with store.engine.begin() as c:
        for table in unlock:
            if c.dialect.name == "sqlite":
                c.execute(sa.text(f"DROP TRIGGER IF EXISTS {table}_no_update"))
                c.execute(sa.text(f"DROP TRIGGER IF EXISTS {table}_no_delete"))
            else:
                c.execute(sa.text(f"ALTER TABLE {table} DISABLE TRIGGER {table}_append_only"))
        for sql, params in statements:
            c.execute(sa.text(sql), params)


def _forged_roles(store, mallory_key):
    """Roles naming mallory a default-approver, stored as a pinned-roles document: what a swap points at."""
    line = public_key_line(load_private_key(mallory_key))
    roles = parse_roles({"actors": {"mallory": {"roles": ["default-approver"], "key": line}}}, "forged")
    store.append_document(
        COLLECTION, roles.digest, roles.digest, {"actors": roles.table(), "source": "x"}, None
    )
    return roles


def _tamper(kind, registry, versions, keys):
    """Edit the store as `kind` says; returns the seq (of the pointer's or the pin's history) named first."""
    store, name = registry.store, registry.pointer_name()
    parent, first, second = versions
    head = registry.history()[-1]  # move 4: parent -> second (a promotion)
    if kind == "move-row":
        _sql(store, ("UPDATE pointers SET value = :v WHERE name = :n", {"v": first, "n": name}))
        return "pointer row"
    if kind == "insert-move":  # shaped like a real promotion: its note copied, the move made up
        row = {"n": name, "s": head.seq + 1, "f": second, "t": first, "a": "alice", "r": None}
        row |= {"note": head.note, "at": head.moved_at + 1}
        _sql(
            store,
            ("INSERT INTO pointer_moves (name, seq, from_value, to_value, actor, receipt_id, note, moved_at) "
             "VALUES (:n, :s, :f, :t, :a, :r, :note, :at)", row),
            ("UPDATE pointers SET value = :t, seq = :s WHERE name = :n", row),
        )  # fmt: skip
        return f"move {head.seq + 1}"
    if kind == "delete-move":
        _sql(
            store,
            ("DELETE FROM pointer_moves WHERE name = :n AND seq = 2", {"n": name}),
            unlock=("pointer_moves",),
        )
        return "move 3"
    if kind == "reorder-moves":
        swap = [("UPDATE pointer_moves SET seq = :b WHERE name = :n AND seq = :a", {"n": name, "a": a, "b": b})
                for a, b in ((2, 100), (3, 2), (100, 3))]  # fmt: skip
        _sql(store, *swap, unlock=("pointer_moves",))
        return "move 2"
    if kind in ("alter-to", "alter-actor"):
        column, value = ("to_value", first) if kind == "alter-to" else ("actor", "mallory")
        _sql(
            store,
            (f"UPDATE pointer_moves SET {column} = :v WHERE name = :n AND seq = :s", {"v": value, "n": name, "s": head.seq}),
            ("UPDATE pointers SET value = :v WHERE name = :n", {"v": first if kind == "alter-to" else second, "n": name}),
            unlock=("pointer_moves",),
        )  # fmt: skip
        return f"move {head.seq}"
    forged = _forged_roles(store, keys["mallory"])
    if kind == "swap-pin-row":
        _sql(store, ("UPDATE pointers SET value = :v WHERE name = :n", {"v": forged.digest, "n": PIN}))
        return "roles pin row"
    if kind == "swap-pin-move":  # a pin move as the registry writes one, unsigned by the roles-admin key
        pinned, seq = store.pointer_state(PIN)
        row = {
            "n": PIN,
            "s": seq + 1,
            "f": pinned,
            "t": forged.digest,
            "a": "roles-admin",
            "at": head.moved_at,
        }
        row["note"] = json.dumps({"source": "forged", "signature": None})
        _sql(
            store,
            ("INSERT INTO pointer_moves (name, seq, from_value, to_value, actor, receipt_id, note, moved_at) "
             "VALUES (:n, :s, :f, :t, :a, NULL, :note, :at)", row),
            ("UPDATE pointers SET value = :t, seq = :s WHERE name = :n", row),
        )  # fmt: skip
        return f"roles pin move {seq + 1}"
    assert kind == "swap-pin-document"  # the pinned document's body rewritten in place
    pinned = store.current_pointer(PIN)
    body = json.dumps({"actors": forged.table(), "source": "forged"})
    _sql(
        store,
        ("UPDATE documents SET body = :b WHERE collection = :c AND doc_id = :d", {"b": body, "c": COLLECTION, "d": pinned}),
        unlock=("documents",),
    )  # fmt: skip
    return "roles pin move 1"


def _cli(capsys, registry, tracking, *argv) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    register(parser)
    url = registry.store.engine.url.render_as_string(hide_password=False)
    args = parser.parse_args(
        [*argv, "--tracking-uri", tracking.uri, "--store-url", url, "--model-name", registry.model_name]
    )
    status = args.handler(args)
    out = capsys.readouterr()
    return status, out.out, out.err


KINDS = [
    "move-row", "insert-move", "delete-move", "reorder-moves", "alter-to", "alter-actor",
    "swap-pin-row", "swap-pin-move", "swap-pin-document",
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_every_reader_detects_a_direct_store_edit(kind, registry, variant, approver_keys, tracking, capsys):
    parent, (first, second) = bootstrap(registry, variant, 2)
    registry_roles(registry)  # the first authorization pins the configured roles file
    signed_move(registry, first.version, approver_keys)  # 2: a promotion
    signed_move(registry, parent.version, approver_keys, rollback=True)  # 3: back
    signed_move(registry, second.version, approver_keys)  # 4: a promotion
    assert registry.verified().problem is None and registry.reconcile().pointer == second.version
    assert registry.serve_approved(download=False).version == second.version
    versions = (parent.version, first.version, second.version)

    named = _tamper(kind, registry, versions, approver_keys)

    pin_edit = kind.startswith("swap-pin")
    # The last verified move: after a swapped pin row or move, every move still verifies under the verified
    # (unswapped) roles; a pinned document rewritten leaves no verified roles, so only the bootstrap stands.
    expected = {"move-row": second, "insert-move": second, "delete-move": parent, "reorder-moves": parent,
                "alter-to": parent, "alter-actor": parent, "swap-pin-document": parent}.get(kind, second).version  # fmt: skip
    chain = registry.verified()
    assert chain.problem is not None and chain.problem.startswith(named), chain.problem
    assert registry.current(APPROVED) == chain.value == expected
    for serve in (registry.serve_approved, registry.resolve):
        with pytest.raises(ChainBroken, match=named):
            serve(download=False)
    with pytest.raises(ChainBroken, match=named):
        promotion.promote(registry, "rec-any", "alice", key=approver_keys["alice"])
    request = rollbacks.rollback_request(
        {
            "target_version": parent.version,
            "from_version": second.version,
            "from_seq": 4,
            "actor": "alice",
            "role": "default-approver",
            "reason": "r",
            "at": 1.0,
        }  # fmt: skip
    )
    with pytest.raises(ChainBroken, match=named):
        rollbacks.rollback(registry, request)
    drill = registry.rollback_drill(parent.version, record=False)
    assert not drill.ok and "ChainBroken" in drill.error and named in drill.error
    # The alias watch compares and restores only the verified history: never the edited pointer.
    assert registry.reconcile(check_only=True).chain.problem == chain.problem
    assert registry.reconcile().pointer == expected
    assert str(registry.client.get_model_version_by_alias(registry.model_name, APPROVED).version) == expected
    status, out, err = _cli(capsys, registry, tracking, "serving")
    assert status == 1 and "does not verify" in err and named in err
    for command in ("show", "history"):
        status, out, err = _cli(capsys, registry, tracking, command)
        assert status == 0 and f"BROKEN: {named}" in out, out + err
    assert "UNVERIFIED" in out or pin_edit or kind == "move-row"
    # One incident however many reads, naming the first bad record; `history` shows it.
    (incident,) = [i for i in registry.incidents() if i.chain]
    assert incident.chain == chain.problem and incident.store_version == expected
    assert incident.summary() in out


def test_a_home_from_before_signed_moves_serves_only_once_the_roles_admin_anchors_it(
    registry, variant, approver_keys, deployment_keys, tracking, capsys
):
    """An old home's moves are unsigned: unverified, so serving refuses; the configured roles-admin's signed
    anchor (no other key) vouches for them, and moves after it verify as usual."""
    parent, (cand,) = bootstrap(registry, variant, 1)
    registry_roles(registry)
    # what the registry wrote before moves were signed: a plain note, no kind, no signature
    legacy = json.dumps({"weights_hash": cand.weights_hash, "note": "promotion"})
    registry.store.move_pointer(registry.pointer_name(), expected=parent.version, to=cand.version, actor="alice",
                                note=legacy)  # fmt: skip
    with pytest.raises(ChainBroken, match="move 2"):
        registry.serve_approved(download=False)
    assert registry.current(APPROVED) == parent.version
    status, _, err = _cli(
        capsys, registry, tracking, "anchor", cand.version, "--key", str(approver_keys["alice"])
    )
    assert status == 1 and "not the configured roles-admin key" in err
    status, out, err = _cli(
        capsys, registry, tracking, "anchor", cand.version, "--key", str(deployment_keys["roles-admin"])
    )
    assert status == 0, err
    assert registry.verified().problem is None and registry.current(APPROVED) == cand.version
    assert registry.serve_approved(download=False).version == cand.version
    status, out, _ = _cli(capsys, registry, tracking, "history")
    assert "history verifies" in out and "VOUCHED" in out
    signed_move(registry, parent.version, approver_keys, rollback=True)  # verified after the anchor
    assert registry.verified().problem is None and registry.current(APPROVED) == parent.version
