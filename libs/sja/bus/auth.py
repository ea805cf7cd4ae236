"""How a process authenticates to NATS: ``NatsSettings`` (the ``SJA_NATS_*`` credentials, TLS files
and reply inbox prefix) and the errors of credentials that cannot work.

``NatsSettings`` is the one definition of these settings: every service holds it as
``BaseSettings.nats`` (read from the environment with the rest of its settings) and ``connect``
takes it. Every field is optional; with none of them a process connects to an open server, which is
what the embedded one-machine stack and the tests use. With a user the connection's reply inbox
moves to ``_INBOX.<user>`` so the server can let each user read only its own replies (see
``infra/nats/auth.conf``).
"""

from __future__ import annotations

import importlib.util
import re
import ssl
from pathlib import Path
from typing import Any

import msgspec

DEFAULT_INBOX_PREFIX = "_INBOX"
_UNSAFE_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


class NatsAuthError(ConnectionError):
    """The server refused this connection's credentials (user/password, creds, NKey or TLS)."""


class NatsConfigError(ValueError):
    """Connection options that cannot work together or point at files that cannot be read."""


class NatsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How to authenticate to NATS (``SJA_NATS_<FIELD>``). Empty means "not used".

    Secrets never appear in ``repr`` or log lines: ``describe()`` names the method, not the secret.
    """

    user: str = ""
    password: str = ""
    password_file: str = ""
    """A file holding the password (a mounted secret); use it or ``password``, not both;
    surrounding whitespace is ignored."""
    creds: str = ""
    """A NATS ``.creds`` file (JWT + NKey seed) for servers in operator mode."""
    nkey_seed: str = ""
    """A file holding an NKey seed (``SU...``), for servers that list users by NKey."""
    tls_ca: str = ""
    """CA bundle for the server's certificate (``tls://`` URLs use the system store without it)."""
    tls_cert: str = ""
    tls_key: str = ""
    """Client certificate and key, for servers that verify clients (mutual TLS)."""
    inbox_prefix: str = ""
    """Reply inbox prefix; empty: ``_INBOX.<user>`` with a user (what ``infra/nats/auth.conf``
    allows), ``_INBOX`` without."""

    def __repr__(self) -> str:
        return f"NatsSettings({self.describe()})"

    @property
    def configured(self) -> bool:
        return any(
            (
                self.user,
                self.password,
                self.password_file,
                self.creds,
                self.nkey_seed,
                self.tls_ca,
                self.tls_cert,
                self.tls_key,
            )
        )

    def with_overrides(self, **overrides: str) -> NatsSettings:
        """These settings with the fields of ``overrides`` that are not empty (command-line options
        over the environment)."""
        given = {k: v for k, v in overrides.items() if v}
        return msgspec.structs.replace(self, **given) if given else self

    def describe(self) -> str:
        """What authenticates this connection, without any secret."""
        parts = []
        if self.user:
            parts.append(f"user {self.user!r}")
        if self.creds:
            parts.append(f"creds {self.creds}")
        if self.nkey_seed:
            parts.append(f"nkey seed {self.nkey_seed}")
        if self.tls_cert:
            parts.append(f"client certificate {self.tls_cert}")
        if self.tls_ca:
            parts.append(f"CA {self.tls_ca}")
        return ", ".join(parts) or "no credentials"

    def effective_inbox_prefix(self) -> str:
        """The reply inbox prefix: explicit, else ``_INBOX.<user>`` (the user made token-safe)."""
        if self.inbox_prefix:
            return self.inbox_prefix
        if self.user:
            return f"{DEFAULT_INBOX_PREFIX}.{_UNSAFE_TOKEN.sub('_', self.user)}"
        return DEFAULT_INBOX_PREFIX

    def resolved_password(self) -> str:
        if self.password and self.password_file:
            raise NatsConfigError("give a NATS password or a password file, not both")
        if self.password_file:
            try:
                return Path(self.password_file).read_text(encoding="utf-8").strip()
            except OSError as e:
                raise NatsConfigError(
                    f"cannot read the NATS password file {self.password_file}: {e}"
                ) from None
        return self.password

    def ssl_context(self) -> ssl.SSLContext | None:
        """A TLS context when any TLS option is set (else ``None``: plain, or ``tls://`` defaults)."""
        if not (self.tls_ca or self.tls_cert or self.tls_key):
            return None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise NatsConfigError("a TLS client certificate needs its key and the key its certificate")
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca or None)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as e:
            raise NatsConfigError(f"bad NATS TLS files ({self.describe()}): {e}") from None
        return ctx

    def connect_options(self) -> dict[str, Any]:
        """Validated keyword arguments for ``nats.connect``."""
        opts: dict[str, Any] = {"inbox_prefix": self.effective_inbox_prefix()}
        password = self.resolved_password()
        if password and not self.user:
            raise NatsConfigError("a NATS password needs a user (SJA_NATS_USER)")
        if self.user:
            opts["user"] = self.user
            opts["password"] = password
        if self.creds and self.nkey_seed:
            raise NatsConfigError("give a NATS creds file or an NKey seed file, not both")
        for path in (self.creds, self.nkey_seed):
            if path and not Path(path).is_file():
                raise NatsConfigError(f"NATS credentials file {path} does not exist")
        if (self.creds or self.nkey_seed) and importlib.util.find_spec("nkeys") is None:
            raise NatsConfigError(
                "NATS creds and NKey seed files need the 'nkeys' package (pip install 'nats-py[nkeys]')"
            )
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.nkey_seed:
            opts["nkeys_seed"] = self.nkey_seed
        ctx = self.ssl_context()
        if ctx is not None:
            opts["tls"] = ctx
        return opts
