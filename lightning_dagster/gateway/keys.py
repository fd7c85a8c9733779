"""Per-attempt API keys: HMAC-signed and self-describing, so a request is attributed without a lookup.

A key is `ld1.<rollout id>.<attempt id>.<signature>` (ids base64url-encoded), the signature
HMAC-SHA256(secret, rollout id + NUL + attempt id). Also: how secrets reach a process (docs/SECURITY.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from lightning_dagster.settings import UsageError

_PREFIX = "ld1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> str:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()


def _signature(secret: str, rollout_id: str, attempt_id: str) -> str:
    return _b64(hmac.new(secret.encode(), f"{rollout_id}\0{attempt_id}".encode(), hashlib.sha256).digest())


def attempt_key(secret: str, rollout_id: str, attempt_id: str) -> str:
    """The key a harness uses for exactly one attempt; it authorises that attempt's spans and rewards only."""
    if not secret:
        raise ValueError("the gateway secret must not be empty")
    ids = f"{_b64(rollout_id.encode())}.{_b64(attempt_id.encode())}"
    return f"{_PREFIX}.{ids}.{_signature(secret, rollout_id, attempt_id)}"


def parse_attempt_key(secret: str, key: str) -> tuple[str, str] | None:
    """(rollout id, attempt id) if `key` is a genuine attempt key under `secret`, else None."""
    parts = key.split(".")
    if len(parts) != 4 or parts[0] != _PREFIX:
        return None
    try:
        rollout_id, attempt_id = _unb64(parts[1]), _unb64(parts[2])
    except (ValueError, UnicodeDecodeError):
        return None
    if not hmac.compare_digest(parts[3], _signature(secret, rollout_id, attempt_id)):
        return None
    return rollout_id, attempt_id


def request_key(request) -> str:
    """The key a request carries: `Authorization: Bearer <key>`, else `x-api-key` ("" without one)."""
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")


def same_key(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


# Never read from the environment: a process's environment is readable by every process of the same user
# (/proc/PID/environ), and unsetting a variable does not erase the copy the kernel shows there.
SECRET_ENV_NAMES = ("LD_GATEWAY_SECRET", "LD_ADMIN_KEY")
MAX_SECRET_BYTES = 4096


class SecretError(ValueError, UsageError):
    """A secret given the wrong way: in the environment, in a file others can read, or empty."""


@dataclass(frozen=True, repr=False)
class GatewayKeys:
    """A gateway's secrets. Never among its options, on a command line or in an environment (a gateway
    child reads them on its standard input); the repr shows no value."""

    secret: str
    admin_key: str
    serve_keys: tuple[str, ...] = ()
    upstream_api_key: str = ""
    agl_key: str = ""

    def __post_init__(self) -> None:
        if not self.secret or not self.admin_key:
            raise SecretError("a gateway needs a non-empty key-signing secret and admin key")
        object.__setattr__(self, "serve_keys", tuple(self.serve_keys))

    def __repr__(self) -> str:
        return "GatewayKeys(...)"

    @classmethod
    def fresh(cls, secret: str = "", admin_key: str = "", **others: object) -> GatewayKeys:
        """Keys with a new random secret and admin key where none is given (hex: never starts with "-",
        which argparse would read as a flag), held in memory only: they die with the gateway."""
        return cls(secret or secrets.token_hex(32), admin_key or secrets.token_hex(32), **others)  # type: ignore[arg-type]


def refuse_env_secrets() -> None:
    """Raise `SecretError` if a gateway secret is set in the environment (see `SECRET_ENV_NAMES`)."""
    found = [name for name in SECRET_ENV_NAMES if os.environ.get(name)]
    if found:
        raise SecretError(
            f"{' and '.join(found)} set in the environment: any process of this user can read it in "
            "/proc/PID/environ; unset it and pass the secret with --secret-file PATH (mode 0600) instead"
        )


def write_secret_file(path: Path, value: str) -> Path:
    """`value` in a new file `path` only this user can read: created with mode 0600, so it is never readable
    by others, not even for a moment (its folder made 0700 if absent; a file there before is replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")
    return path


def read_secret_file(path: str | Path) -> str:
    """The secret in `path` (stripped; `-`: one line of standard input), a regular file of this user's
    that no one else can read or write; else `SecretError` naming the path and the cause."""
    if str(path) == "-":
        value = sys.stdin.readline().strip()
        if not value:
            raise SecretError("no secret on standard input")
        return value
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SecretError(f"cannot open the secret file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"the secret file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise SecretError(f"the secret file {path} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o077:
            raise SecretError(
                f"the secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read it; "
                f"chmod 600 {path}"
            )
        value = os.read(fd, MAX_SECRET_BYTES + 1).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if len(value) > MAX_SECRET_BYTES:
        raise SecretError(f"the secret file {path} holds more than {MAX_SECRET_BYTES} bytes: not a secret")
    if not value:
        raise SecretError(f"the secret file {path} is empty")
    return value
