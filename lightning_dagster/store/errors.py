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
        self.name, self.expected, self.actual = name, expected, actual


class PointerSeqConflict(PointerConflict):
    """Compare-and-set on the move number failed: the pointer moved since it was read (even A -> B -> A)."""

    def __init__(
        self, name: str, expected: str | None, actual: str | None, expected_seq: int, actual_seq: int
    ):
        super().__init__(name, expected, actual)
        self.args = (
            f"pointer {name!r}: expected move {expected_seq} ({expected!r}), actual move {actual_seq} "
            f"({actual!r}); it moved since it was read",
        )
        self.expected_seq, self.actual_seq = expected_seq, actual_seq


class InvalidInput(ValueError):
    """Input SQLite and PostgreSQL cannot store alike; the message starts with the field's name."""


class StoreUnavailable(RuntimeError):
    """The store cannot do what was asked at all; the message is one line naming the store and the cause."""


class StoreLocked(StoreUnavailable):
    """Another process held the write lock for longer than the store's bounded wait (`busy_timeout_s`)."""


class StoreReadOnly(StoreUnavailable):
    """A write to a store opened read-only (file permissions, a `mode=ro` URL...); reads keep working."""
