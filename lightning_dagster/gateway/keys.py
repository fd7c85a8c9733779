"""Per-attempt API keys: HMAC-signed and self-describing, so a request is attributed without a lookup.

A key is `ld1.<rollout id>.<attempt id>.<signature>`, the ids base64url-encoded so that any id survives
the dots; the signature is HMAC-SHA256(secret, rollout id + NUL + attempt id). Keys are compared in
constant time and never logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

_PREFIX = "ld1"


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()


def _signature(secret: str, rollout_id: str, attempt_id: str) -> str:
    mac = hmac.new(secret.encode(), f"{rollout_id}\0{attempt_id}".encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")


def attempt_key(secret: str, rollout_id: str, attempt_id: str) -> str:
    """The key a harness uses for exactly one attempt; it authorises that attempt's spans and rewards only."""
    if not secret:
        raise ValueError("the gateway secret must not be empty")
    return f"{_PREFIX}.{_b64(rollout_id)}.{_b64(attempt_id)}.{_signature(secret, rollout_id, attempt_id)}"


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


def same_key(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets."""
    return hmac.compare_digest(given.encode(), expected.encode())
