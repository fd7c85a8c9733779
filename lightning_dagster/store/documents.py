"""Append-only, hash-chained documents, compare-and-set pointers with their move history, and flags."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from lightning_dagster.store import schema
from lightning_dagster.store.connection import Connection, checked, nonempty_text
from lightning_dagster.store.errors import Conflict, InvalidInput, PointerConflict, PointerSeqConflict
from lightning_dagster.store.records import PointerMove, StoredDocument
from lightning_dagster.types import now


def append_chained(
    store: Any,
    collection: str,
    doc_id: str,
    body: dict,
    digest: Callable[[str | None], str],
    *,
    unless: Callable[[list[StoredDocument]], bool] | None = None,
    attempts: int = 5,
) -> int | None:
    """Append `body` hashed `digest(head hash)` in `attempts` tries (then `Conflict`); None if `unless`."""
    for _ in range(attempts):
        versions = store.document_versions(collection, doc_id)
        if unless is not None and unless(versions):
            return None
        head = versions[-1].content_hash if versions else None
        try:
            return store.append_document(collection, doc_id, digest(head), body, head)
        except Conflict:
            continue
    raise Conflict(f"could not append to {collection}/{doc_id} after {attempts} attempts")


class DocumentStore(Connection):
    def append_document(
        self, collection: str, doc_id: str, content_hash: str, body: dict, previous_hash: str | None
    ) -> int:
        """Append version n+1, whose `previous_hash` must be version n's content hash (else Conflict)."""
        d = schema.documents.c
        for name, value in (("collection", collection), ("doc_id", doc_id), ("content_hash", content_hash)):
            nonempty_text(name, value)
        if not isinstance(body, dict):
            raise InvalidInput(f"document body must be a dict, got {type(body).__name__}")
        with self._write() as c:
            head = c.execute(
                sa.select(d.version, d.content_hash)
                .where(d.collection == collection, d.doc_id == doc_id)
                .order_by(d.version.desc())
                .limit(1)
                .with_for_update(key_share=True)
            ).first()
            head_hash = head.content_hash if head else None
            if previous_hash != head_hash:
                raise Conflict(
                    f"document {collection}/{doc_id}: previous_hash {previous_hash!r} is not the head {head_hash!r}"
                )
            version = head.version + 1 if head else 1
            row = dict(collection=collection, doc_id=doc_id, version=version, content_hash=content_hash)
            row.update(previous_hash=previous_hash, body=body, created_at=now())
            c.execute(schema.documents.insert(), checked(schema.documents, row))
        return version

    def document_versions(self, collection: str, doc_id: str) -> list[StoredDocument]:
        d = schema.documents.c
        query = sa.select(schema.documents).where(d.collection == collection, d.doc_id == doc_id)
        return self._all(StoredDocument, query.order_by(d.version))

    def move_pointer(
        self,
        name: str,
        *,
        expected: str | None,
        to: str,
        actor: str,
        receipt_id: str | None = None,
        note: str = "",
        expected_seq: int | None = None,
    ) -> PointerMove:
        """Compare-and-set under a row lock from `expected` (None: never set), else PointerConflict; with
        `expected_seq` (0: never moved) also only if nothing moved since, else `PointerSeqConflict`."""
        for field, value in (("name", name), ("to", to), ("actor", actor)):
            nonempty_text(field, value)
        if expected_seq is not None and (
            isinstance(expected_seq, bool) or not isinstance(expected_seq, int) or expected_seq < 0
        ):
            raise InvalidInput(f"expected_seq must be a non-negative integer, got {expected_seq!r}")
        p = schema.pointers.c
        try:
            with self._write() as c:
                row = c.execute(
                    sa.select(schema.pointers).where(p.name == name).with_for_update(key_share=True)
                ).first()
                actual = row.value if row else None
                actual_seq = row.seq if row else 0
                if expected_seq is not None and actual_seq != expected_seq:
                    raise PointerSeqConflict(name, expected, actual, expected_seq, actual_seq)
                if actual != expected:
                    raise PointerConflict(name, expected, actual)
                move = PointerMove(
                    name=name, from_value=actual, to_value=to, actor=actor, receipt_id=receipt_id, note=note,
                    moved_at=now(), seq=actual_seq + 1,
                )  # fmt: skip
                state = {"value": to, "seq": move.seq, "updated_at": move.moved_at}
                if row:
                    c.execute(sa.update(schema.pointers).where(p.name == name).values(state))
                else:  # a concurrent first move fails on the primary key and becomes a PointerConflict
                    c.execute(schema.pointers.insert(), {"name": name, **state})
                c.execute(schema.pointer_moves.insert(), checked(schema.pointer_moves, move.model_dump()))
        except PointerConflict:
            raise
        except Conflict as exc:
            value, seq = self.pointer_state(name)
            if expected_seq is not None:
                raise PointerSeqConflict(name, expected, value, expected_seq, seq) from exc
            raise PointerConflict(name, expected, value) from exc
        return move

    def pointer_state(self, name: str) -> tuple[str | None, int]:
        """(value, newest move's `seq`) in one read ((None, 0): never set), as `move_pointer` takes them."""
        p = schema.pointers.c
        with self.engine.connect() as c:
            row = c.execute(sa.select(p.value, p.seq).where(p.name == name)).first()
        return (row.value, row.seq) if row else (None, 0)

    def current_pointer(self, name: str) -> str | None:
        """One primary-key read of the pointer row (the history is not touched)."""
        return self.pointer_state(name)[0]

    def pointer_history(self, name: str, *, last: int | None = None) -> list[PointerMove]:
        """Every move (with `last`: the newest `last`), oldest first."""
        m = schema.pointer_moves.c
        query = sa.select(schema.pointer_moves).where(m.name == name)
        if last is None:
            return self._all(PointerMove, query.order_by(m.seq))
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise InvalidInput(f"last must be a non-negative integer, got {last!r}")
        return self._all(PointerMove, query.order_by(m.seq.desc()).limit(last))[::-1]

    def set_flag(self, key: str, value: dict) -> None:
        nonempty_text("key", key)
        if not isinstance(value, dict):
            raise InvalidInput(f"flag value must be a dict, got {type(value).__name__}")
        checked(schema.flags, {"key": key, "value": value})
        with self._write() as c:
            dialect = postgresql if c.dialect.name == "postgresql" else sqlite
            insert = dialect.insert(schema.flags).values(key=key, value=value, updated_at=now())
            fresh = {"value": insert.excluded.value, "updated_at": insert.excluded.updated_at}
            c.execute(insert.on_conflict_do_update(index_elements=["key"], set_=fresh))

    def get_flag(self, key: str) -> dict | None:
        with self.engine.connect() as c:
            return c.execute(sa.select(schema.flags.c.value).where(schema.flags.c.key == key)).scalar()
