"""How a process authenticates to NATS: ``NatsSettings`` (the ``SJA_NATS_*`` credentials, TLS files
and reply inbox prefix), the credentials file (``Credentials``: one user's name and password, the
server's URL and, for a tenant, its name; written only its owner can read) and the errors of
credentials that cannot work.

A credentials file (``SJA_NATS_CREDENTIALS``) keeps the secret out of the process's environment,
which any process of the same uid reads in ``/proc/<pid>/environ``; ``SJA_NATS_PASSWORD`` still
works (the compose deployment's way) but is that much weaker. ``sja up`` writes one file per
service, the operator's and one per tenant; the CLI finds its file as ``kubectl`` finds its
kubeconfig: ``--credentials``, then ``SJA_NATS_CREDENTIALS``, then ``default_credentials_path()``.

``NatsSettings`` is the one definition of these settings: every service holds it as
``BaseSettings.nats`` (read from the environment with the rest of its settings) and ``connect``
takes it. Every field is optional; with none of them a process connects to an open server, which is
what the embedded one-machine stack and the tests use. With a user the connection's reply inbox
moves to ``_INBOX.<user>`` so the server can let each user read only its own replies (see
``infra/nats/auth.conf``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import ssl
import stat
from pathlib import Path
from typing import Any

import msgspec

DEFAULT_INBOX_PREFIX = "_INBOX"
_UNSAFE_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


class NatsAuthError(ConnectionError):
    """The server refused this connection's credentials (user/password, creds, NKey or TLS)."""


class NatsConfigError(ValueError):
    """Connection options that cannot work together or point at files that cannot be read."""


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """What a credentials file holds (JSON): one NATS user and its password; the server's URL; for a
    tenant's user, the tenant it acts for."""

    user: str
    password: str
    url: str = ""
    tenant: str = ""

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, url={self.url!r}, tenant={self.tenant!r})"


def default_credentials_path() -> Path:
    """Where ``sja up`` writes the operator's credentials and the CLI looks last:
    ``$XDG_CONFIG_HOME/sja/credentials.json`` (``~/.config/sja/credentials.json``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "sja" / "credentials.json"


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner can enter (0700), made if missing."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def write_credentials(path: Path, creds: Credentials) -> Path:
    """Write ``creds`` to ``path``, readable by its owner only (0600, in a 0700 directory), replacing
    any file there at once (never a moment with the secret readable by others)."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, msgspec.json.encode(creds) + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_credentials(path: str | Path) -> Credentials:
    """The credentials of a file only its owner may read: a file that the group or others can read
    is refused (as ``ssh`` refuses such a key), naming the fix."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise NatsConfigError(f"cannot read the NATS credentials file {p}: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise NatsConfigError(
                f"the NATS credentials file {p} is open to others (mode {stat.S_IMODE(mode):o}): "
                f"chmod 600 {p}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(64 * 1024)
    finally:
        os.close(fd)
    try:
        return msgspec.json.decode(raw, type=Credentials)
    except msgspec.DecodeError as e:
        raise NatsConfigError(f"bad NATS credentials file {p}: {e}") from None


class NatsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How to authenticate to NATS (``SJA_NATS_<FIELD>``). Empty means "not used".

    Secrets never appear in ``repr`` or log lines: ``describe()`` names the method, not the secret.
    """

    credentials: str = ""
    """A credentials file (``Credentials``, JSON, mode 0600): its user and password, unless
    ``user``/``password`` are given. The secret stays out of the environment."""
    user: str = ""
    password: str = ""
    """In the environment (``SJA_NATS_PASSWORD``) any process of the same uid can read it in
    ``/proc/<pid>/environ``: prefer ``credentials`` or ``password_file``."""
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
                self.credentials,
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
        if self.credentials:
            parts.append(f"credentials {self.credentials}")
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

    def for_service(self, service: str) -> NatsSettings:
        """A service's settings: ``credentials`` naming a directory (``sja up`` gives one to every
        service process, co-hosted ones included) means its file ``<dir>/sja-<service>.json``."""
        if self.credentials and Path(self.credentials).is_dir():
            path = Path(self.credentials) / f"sja-{service}.json"
            return msgspec.structs.replace(self, credentials=str(path))
        return self

    def credentials_file(self) -> Credentials | None:
        """The credentials file's contents (``None`` without one)."""
        return read_credentials(self.credentials) if self.credentials else None

    def resolved(self) -> NatsSettings:
        """These settings with the credentials file's user and password in place (a user or
        password given as well wins; a different user than the file's is an error)."""
        creds = self.credentials_file()
        if creds is None:
            return self
        if self.user and self.user != creds.user:
            if self.password or self.password_file:
                return msgspec.structs.replace(self, credentials="")
            raise NatsConfigError(
                f"the NATS credentials file {self.credentials} is user {creds.user!r}'s, not {self.user!r}"
            )
        if self.password or self.password_file:
            return msgspec.structs.replace(self, credentials="", user=creds.user)
        return msgspec.structs.replace(self, credentials="", user=creds.user, password=creds.password)

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
        if self.credentials:
            return self.resolved().connect_options()
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
