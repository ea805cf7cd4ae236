"""Who may open the dashboard: tokens derived from one operator secret.

The dashboard (``services/ui``) holds one random secret, in a file only its user can read
(``SJA_UI_TOKEN_FILE``; ``sja up`` writes one at every start). Nothing else is stored: every token
is an HMAC of the secret, so the service checks a token by computing it again.

- the operator's token, ``o.<hex>``, opens the operator view (every tenant's jobs);
- a tenant's token, ``t.<tenant>.<hex>``, opens that tenant's view (its own jobs only); the operator
  mints one with ``sja dashboard-token --tenant NAME``.

A new secret invalidates every token minted from the old one. The secret itself never travels: it
is not a token.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

SECRET_BYTES = 32
MIN_SECRET_CHARS = 32
"""A secret file holding less than this (stripped) is refused: too easy to guess."""
TENANT = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A tenant's name as a job spec has it (``NAME_PATTERN``)."""


class SecretError(ValueError):
    """The secret file cannot be read, or holds no usable secret."""


@dataclass(frozen=True)
class Viewer:
    """Who a valid token belongs to: the operator (``tenant`` is ``None``) or one tenant."""

    tenant: str | None = None

    @property
    def is_operator(self) -> bool:
        return self.tenant is None

    def may_see(self, tenant: str) -> bool:
        """Whether this viewer may see a job of ``tenant``."""
        return self.tenant is None or self.tenant == tenant


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def write_secret(path: Path, secret: str | None = None) -> str:
    """Write ``secret`` (a new one by default) to ``path``, readable by its owner only (its directory
    created ``0700`` when missing), replacing any earlier one at once; returns the secret."""
    secret = secret or new_secret()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secret + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return secret


def read_secret(path: Path) -> str:
    """The secret held by ``path``; ``SecretError`` when missing, unreadable or too short."""
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SecretError(f"dashboard secret {path}: {type(e).__name__}: {e}") from None
    if len(secret) < MIN_SECRET_CHARS:
        raise SecretError(f"dashboard secret {path}: shorter than {MIN_SECRET_CHARS} characters")
    return secret


def ensure_secret(path: Path) -> str:
    """The secret of ``path``, written there first (a new one) when there is no such file."""
    if not path.exists():
        return write_secret(path)
    return read_secret(path)


def _mac(secret: str, what: str) -> str:
    return hmac.new(secret.encode(), f"sja-dashboard/{what}".encode(), hashlib.sha256).hexdigest()


def operator_token(secret: str) -> str:
    return f"o.{_mac(secret, 'operator')}"


def tenant_token(secret: str, tenant: str) -> str:
    """The token of ``tenant``'s view; ``ValueError`` for a name no job can have."""
    if not TENANT.fullmatch(tenant):
        raise ValueError(f"not a tenant name: {tenant!r} (letters, digits, _ and -)")
    return f"t.{tenant}.{_mac(secret, 'tenant/' + tenant)}"


def viewer_of(token: str, secret: str) -> Viewer | None:
    """Whose token it is, or ``None`` when it is no valid token (compared in constant time)."""
    if not token.isascii() or len(token) > 200:
        return None
    if token.startswith("o."):
        return Viewer() if hmac.compare_digest(token, operator_token(secret)) else None
    if token.startswith("t."):
        tenant, sep, _mac_hex = token[2:].rpartition(".")
        if not sep or not TENANT.fullmatch(tenant):
            return None
        return Viewer(tenant) if hmac.compare_digest(token, tenant_token(secret, tenant)) else None
    return None


__all__ = [
    "SecretError",
    "Viewer",
    "ensure_secret",
    "new_secret",
    "operator_token",
    "read_secret",
    "tenant_token",
    "viewer_of",
    "write_secret",
]
