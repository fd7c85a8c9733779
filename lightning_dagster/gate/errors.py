"""The gate's exceptions: bad input names the field it is about, so a caller can fix exactly that."""

from __future__ import annotations

from pydantic import ValidationError

from lightning_dagster.settings import UsageError

# Prefix of a validator message that names a sub-field of the location pydantic reports.
SUBFIELD = "Value error, @"


def subfield_error(field: str, message: str) -> ValueError:
    """An error a model validator raises about one of its fields (see `from_validation_error`)."""
    return ValueError(f"@{field}: {message}")


class InvalidInput(ValueError, UsageError):
    """A receipt, policy or fingerprint file that cannot be judged. `fields` lists the dotted paths at fault."""

    def __init__(self, what: str, problems: list[tuple[str, str]]):
        self.what, self.problems, self.fields = what, problems, [field for field, _ in problems]
        detail = "; ".join(f"{field or '<root>'}: {message}" for field, message in problems)
        super().__init__(f"invalid {what}: {detail}")


class AmendmentError(ValueError):
    """An amendment tried to change evidence already recorded (only additions are allowed)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"amendment rejected at {field}: {message}")


class TamperedReceipt(RuntimeError):
    """A stored receipt chain does not verify; `incident`: the one recording it (None: none could be)."""

    def __init__(self, message: str, incident: object = None):
        super().__init__(message)
        self.incident = incident


def from_validation_error(what: str, err: ValidationError, prefix: str = "") -> InvalidInput:
    """Translate pydantic's error list into `InvalidInput` with dotted field paths (`plan.parent.uri`)."""
    problems = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        message = e["msg"]
        if e["type"] == "extra_forbidden":
            message = "unknown field"
        elif message.startswith(SUBFIELD):
            # a model validator names the sub-field it is about: "@statuses: has 1 entries for 120"
            sub, _, message = message[len(SUBFIELD) :].partition(": ")
            path = f"{path}.{sub}" if path else sub
        problems.append((path, message))
    return InvalidInput(what, problems)
