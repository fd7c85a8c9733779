"""The release's named refusals. Each is a `RegistryError`: every caller that reports a refused registry
operation (the CLI's exit status 1, the Dagster jobs' one-line failure) catches that class.
"""

from __future__ import annotations

from lightning_dagster.registry.errors import RegistryError
from lightning_dagster.settings import UsageError


class NotAuthorized(RegistryError):
    """`actor` may not act in `role` here; `reason` says exactly what is missing, in one line."""

    refused = "not authorized"

    def __init__(self, actor: str, role: str, reason: str):
        super().__init__(f"{self.refused}: {reason}")
        self.actor, self.role, self.reason = actor, role, reason


class RollbackRefused(NotAuthorized):
    """A rollback that is not an authorized actor's signed decision over exactly this move."""

    refused = "rollback refused"


class RolesConfigError(RegistryError):
    """The roles are missing, malformed, inside the learner's write surface, or not the pinned ones."""


class KeyFileError(RegistryError, UsageError):
    """A private key file is missing, unreadable, readable by others, or not an Ed25519 key."""


class ApprovalRefused(RegistryError):
    """An approval proves nothing: unsigned, wrongly signed, by an unknown actor, or over other evidence."""

    def __init__(self, problems: list[str]):
        super().__init__("approval refused: " + "; ".join(problems))
        self.problems = problems


class PromotionRefused(RegistryError):
    def __init__(self, reason: str):
        super().__init__(f"promotion refused: {reason}")
        self.reason = reason
