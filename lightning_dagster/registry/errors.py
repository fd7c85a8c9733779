"""The registry's named errors. `PointerConflict` is the store's: one class for every compare-and-set loss."""

from __future__ import annotations

from lightning_dagster.store.errors import PointerConflict as PointerConflict


class RegistryError(Exception):
    """Base class of the registry's own errors, and of the release's refusals (`release.errors`)."""


class RegistryUnavailable(RegistryError):
    """The MLflow tracking server (or database) could not be reached; nothing was changed."""

    def __init__(self, uri: str, cause: BaseException | str):
        super().__init__(f"MLflow tracking store {uri} is unavailable: {cause}")
        self.uri, self.cause = uri, cause


class PointerNotSet(RegistryError):
    """The pointer was never moved; it has no value and is never substituted by another one."""

    def __init__(self, name: str):
        super().__init__(f"pointer {name!r} is not set (it is never substituted by latest-candidate)")
        self.name = name


class UnknownVersion(RegistryError):
    def __init__(self, model_name: str, version: str):
        super().__init__(f"model {model_name!r} has no version {version!r}")
        self.model_name, self.version = model_name, version


class WeightsMismatch(RegistryError):
    """The downloaded checkpoint's bytes do not hash to the weights hash registered for the version."""

    hashed = "weights hash"

    def __init__(self, version: str, expected: str, actual: str, changed: list[str] | None = None):
        self.version, self.expected, self.actual = version, expected, actual
        self.changed = list(changed or [])
        also = f" (changed: {', '.join(self.changed)})" if self.changed else ""
        super().__init__(
            f"version {version}: {self.hashed} {actual} does not match the registered {expected}{also}"
        )


class CheckpointFilesMismatch(WeightsMismatch):
    """The checkpoint's other files do not hash to the registered `files_hash` (or a symlink leaves the
    checkpoint); `changed` names the files that differ when the registered file list is known."""

    hashed = "checkpoint files hash"


class AliasDiverged(RegistryError):
    """MLflow's alias names another version than the store's pointer: the alias is not served."""

    def __init__(self, model_name: str, alias: str, alias_version: str | None, store_version: str | None):
        super().__init__(
            f"refusing to serve {model_name}@{alias}: MLflow's alias names "
            f"{alias_version or '(no version)'}, the store's pointer is {store_version or '(unset)'}"
        )
        self.model_name, self.alias = model_name, alias
        self.alias_version, self.store_version = alias_version, store_version


class ChainBroken(RegistryError):
    """A pointer's signed history (or the roles pin it is verified against) does not verify from its first
    move to its head: `problem` names the first bad record. The pointer reads as its last verified move."""

    def __init__(self, pointer: str, problem: str, verified: str | None):
        super().__init__(
            f"{pointer}'s history does not verify: {problem}; the last verified value is "
            f"{verified or '(none)'} (a recorded incident: `lightning-dagster registry history`; the roles-admin "
            "re-anchors a checked version with `lightning-dagster registry anchor VERSION --key KEY`)"
        )
        self.pointer, self.problem, self.verified = pointer, problem, verified
