"""Pointer moves compare-and-set on the move number: a pointer moved A -> B -> A by another actor between a
promotion's or rollback's read and its move keeps its value, yet the stale decision is refused."""

from __future__ import annotations

import pytest

from lightning_dagster.registry import PointerConflict
from lightning_dagster.release import promotion, rollbacks
from lightning_dagster.store import PointerSeqConflict
from tests.registry.helpers import approve, candidate_kwargs, passing_receipt, signed_move, signed_rollback

pytestmark = pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)


class RacedBeforeMove:
    """The real store, except that another actor moves the pointer away and back (A -> B -> A) right
    before the caller's first move: after every read and check the caller made, before its compare-and-set."""

    def __init__(self, registry, detour: str, keys):
        self._store, self._registry, self._detour, self._keys = registry.store, registry, detour, keys
        self.raced = False

    def move_pointer(self, name, **kwargs):
        if name == self._registry.pointer_name() and not self.raced:
            self.raced = True
            back = self._store.pointer_state(name)[0]  # the way back (a rollback) records the same weights
            signed_move(self._registry, self._detour, self._keys, "alice")
            signed_move(self._registry, back, self._keys, "alice", rollback=True)
        return self._store.move_pointer(name, **kwargs)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_promotion_is_refused_when_the_pointer_went_away_and_back(registry, variant, approver_keys):
    parent = registry.register_initial_parent(variant(0))
    cand, other = (registry.log_candidate(variant(k), **candidate_kwargs(parent.version)) for k in (1, 2))
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-aba", approver_keys), approver_keys, "alice"
    )
    real = registry.store
    registry.store = raced = RacedBeforeMove(registry, other.version, approver_keys)
    with pytest.raises(PointerSeqConflict) as err:
        promotion.promote(registry, "rec-aba", "alice", key=approver_keys["alice"])
    assert raced.raced
    assert (err.value.expected_seq, err.value.actual_seq) == (1, 3)
    assert (err.value.expected, err.value.actual) == (parent.version, parent.version)
    assert "expected move 1" in str(err.value) and "actual move 3" in str(err.value)
    assert [(m.seq, m.to_value, m.actor) for m in real.pointer_history(registry.pointer_name())] == [
        (1, parent.version, "bootstrap"),
        (2, other.version, "alice"),
        (3, parent.version, "alice"),
    ]
    # Nothing raced: the same receipt, read afresh, promotes (the move number it read is the newest).
    registry.store = real
    result = promotion.promote(registry, "rec-aba", "alice", key=approver_keys["alice"])
    assert (result.move.seq, result.move.from_value, result.move.to_value) == (
        4,
        parent.version,
        cand.version,
    )


def test_rollback_is_refused_when_the_pointer_went_away_and_back(registry, variant, approver_keys):
    parent = registry.register_initial_parent(variant(0))
    cand, other = (registry.log_candidate(variant(k), **candidate_kwargs(parent.version)) for k in (1, 2))
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-aba-rb", approver_keys), approver_keys, "alice"
    )
    promotion.promote(registry, "rec-aba-rb", "alice", key=approver_keys["alice"])
    request = signed_rollback(registry, parent.version, "alice", approver_keys)
    real = registry.store
    registry.store = RacedBeforeMove(registry, other.version, approver_keys)
    with pytest.raises(PointerSeqConflict) as err:
        rollbacks.rollback(registry, request)
    assert (err.value.expected_seq, err.value.actual_seq) == (2, 4)
    assert real.pointer_state(registry.pointer_name()) == (cand.version, 4)
    assert [m.actor for m in real.pointer_history(registry.pointer_name())][-2:] == ["alice", "alice"]


def test_bootstrap_passes_the_move_number_it_read(registry, variant):
    """A second bootstrap is refused, and the store's move is checked on the move number the bootstrap read
    (0): a first move another process made in between is refused by number, not only by value."""
    parent = registry.register_initial_parent(variant(0))
    assert registry.store.pointer_state(registry.pointer_name()) == (parent.version, 1)
    with pytest.raises(PointerConflict):
        registry.register_initial_parent(variant(0))
    calls = []
    real = registry.store

    class Spy:
        def move_pointer(self, name, **kwargs):
            calls.append(kwargs.get("expected_seq"))
            return real.move_pointer(name, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    registry.store, registry.model_name = Spy(), registry.model_name + "-b"
    registry._model_ready = False
    registry.register_initial_parent(variant(0))
    assert calls == [0]
