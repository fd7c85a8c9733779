"""Named errors of the store; `IllegalTransition` lives with the state machine in `lightning_dagster.types`."""

from __future__ import annotations


class NotFound(KeyError):
    """An id the caller named does not exist (HTTP edges map it to 404)."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else "not found"


class Conflict(RuntimeError):
    """The write would contradict what is stored (duplicate id, stale document head); maps to 409."""


class PointerConflict(Conflict):
    """Compare-and-set failed: the pointer's current value is not the one the caller expected."""

    def __init__(self, name: str, expected: str | None, actual: str | None):
        super().__init__(f"pointer {name!r}: expected {expected!r}, actual {actual!r}")
        self.name = name
        self.expected = expected
        self.actual = actual


class InvalidInput(ValueError):
    """Input that passed type validation but cannot be stored (e.g. a token id outside int32)."""
