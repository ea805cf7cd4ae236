"""Connecting to NATS and declaring the JetStream streams and KV buckets SJA uses.

``connect`` takes optional credentials (``NatsAuth``: user and password or a password file, a
``.creds`` file, an NKey seed file, TLS CA / client certificate and key). With none of them it
connects as before, which is what the embedded one-machine stack and the tests use. With a user it
also moves the connection's reply inbox to ``_INBOX.<user>`` so the server can let each user read
only its own replies (see ``infra/nats/auth.conf``).

The server reports a publish or subscribe it refuses (``Permissions Violation``) without closing the
connection; ``connect`` logs each one at ERROR with the subject and hands it to the caller's
``on_permission_violation`` so services can count them. A refused login fails ``connect`` at once
with ``NatsAuthError`` instead of retrying forever.

A service waits for its server as long as it takes (the default). A client (the CLI, ``SjaClient``)
passes ``first_connect_retries``: with no server at the URL, ``connect`` then fails within seconds
with ``NatsUnreachableError`` instead of retrying forever.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from sja.bus.natsclient import Client as CoalescingClient
from sja.protocol import subjects
from sja.protocol.messages import Message

if TYPE_CHECKING:
    from sja.bus.settings import BaseSettings

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
H = TypeVar("H")

SCAN_CHUNK = 256
"""Entries a bucket read handles between two turns of the event loop. Reading a bucket of
thousands of jobs in one go stalled a busy agent for tens of milliseconds (its periodic scan for
the jobs of silent agents), and every message waiting on it with it."""

DAY_S = 86_400.0

DEFAULT_INBOX_PREFIX = "_INBOX"
_UNSAFE_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


class NatsAuthError(ConnectionError):
    """The server refused this connection's credentials (user/password, creds, NKey or TLS)."""


class NatsUnreachableError(ConnectionError):
    """No NATS server answered at the URL within the retries of a bounded first connection."""

    def __init__(self, url: str, last_error: str) -> None:
        super().__init__(f"no NATS server answers at {url}" + (f" ({last_error})" if last_error else ""))
        self.url = url


class NatsConfigError(ValueError):
    """Connection options that cannot work together or point at files that cannot be read."""


@dataclass(frozen=True)
class NatsAuth:
    """How to authenticate to NATS. Every field is optional; empty means "not used".

    Secrets never appear in ``repr`` or log lines: ``describe()`` names the method, not the secret.
    """

    user: str = ""
    password: str = ""
    password_file: str = ""
    """A file holding the password (a mounted secret); surrounding whitespace is ignored."""
    creds_file: str = ""
    """A NATS ``.creds`` file (JWT and NKey seed), for servers run in operator mode."""
    nkey_seed_file: str = ""
    """A file holding an NKey seed (``SU...``), for servers that list users by NKey."""
    tls_ca: str = ""
    """CA bundle that signed the server's certificate (else the system trust store)."""
    tls_cert: str = ""
    tls_key: str = ""
    """Client certificate and key, for servers that verify clients (mutual TLS)."""
    inbox_prefix: str = ""
    """Reply inbox prefix; empty: ``_INBOX.<user>`` with a user, ``_INBOX`` without."""

    def __repr__(self) -> str:
        return f"NatsAuth({self.describe()})"

    @classmethod
    def from_settings(cls, settings: BaseSettings, **overrides: str) -> NatsAuth:
        """The credentials of a service or CLI from its settings (``SJA_NATS_*``)."""
        fields: dict[str, str] = {
            "user": settings.nats_user,
            "password": settings.nats_password,
            "password_file": settings.nats_password_file,
            "creds_file": settings.nats_creds,
            "nkey_seed_file": settings.nats_nkey_seed,
            "tls_ca": settings.nats_tls_ca,
            "tls_cert": settings.nats_tls_cert,
            "tls_key": settings.nats_tls_key,
            "inbox_prefix": settings.nats_inbox_prefix,
        }
        fields.update({k: v for k, v in overrides.items() if v})
        return cls(**fields)

    @property
    def configured(self) -> bool:
        return any(
            (
                self.user,
                self.password,
                self.password_file,
                self.creds_file,
                self.nkey_seed_file,
                self.tls_ca,
                self.tls_cert,
                self.tls_key,
            )
        )

    def describe(self) -> str:
        """What authenticates this connection, without any secret."""
        parts = []
        if self.user:
            parts.append(f"user {self.user!r}")
        if self.creds_file:
            parts.append(f"creds {self.creds_file}")
        if self.nkey_seed_file:
            parts.append(f"nkey seed {self.nkey_seed_file}")
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
        if self.creds_file and self.nkey_seed_file:
            raise NatsConfigError("give a NATS creds file or an NKey seed file, not both")
        for path in (self.creds_file, self.nkey_seed_file):
            if path and not Path(path).is_file():
                raise NatsConfigError(f"NATS credentials file {path} does not exist")
        if (self.creds_file or self.nkey_seed_file) and importlib.util.find_spec("nkeys") is None:
            raise NatsConfigError(
                "NATS creds and NKey seed files need the 'nkeys' package (pip install 'nats-py[nkeys]')"
            )
        if self.creds_file:
            opts["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            opts["nkeys_seed"] = self.nkey_seed_file
        ctx = self.ssl_context()
        if ctx is not None:
            opts["tls"] = ctx
        return opts


@dataclass(frozen=True)
class PermissionViolation:
    """A publish or subscribe the server refused for this connection's user."""

    operation: str
    """``publish`` or ``subscription``."""
    subject: str
    """As the server reported it (the client library lower-cases server errors)."""
    message: str


_VIOLATION = re.compile(
    r"permissions violation for (publish|subscription) to \"?([^\"\s]+)\"?", re.IGNORECASE
)


def parse_permission_violation(error: object) -> PermissionViolation | None:
    """The violation a NATS error reports, or ``None`` for any other error."""
    text = str(error)
    found = _VIOLATION.search(text)
    if found is None:
        return None
    return PermissionViolation(operation=found.group(1).lower(), subject=found.group(2), message=text)


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    first_connect_retries: int | None = None,
    auth: NatsAuth | None = None,
    on_permission_violation: Callable[[PermissionViolation], None] | None = None,
) -> CoalescingClient:
    """Connect with unbounded reconnects: a restarted server is rejoined, not fatal.

    Credentials come from ``auth`` (none: an open server, as the dev stack runs). A server that
    refuses the credentials at the first connection fails this call with ``NatsAuthError``; bad
    options (a missing file, a password without user) fail with ``NatsConfigError`` before any I/O.

    Args:
        first_connect_retries: ``None`` retries the first connection forever (a service started
            before its server). A number ``n >= 1`` tries each server of ``url`` ``n + 1`` times,
            then fails with ``NatsUnreachableError`` (a client: the CLI must not hang). Once
            connected, reconnects are unbounded either way.
    """
    if first_connect_retries is not None and first_connect_retries < 1:
        raise ValueError("first_connect_retries must be at least 1 (None: retry forever)")
    bounded = first_connect_retries is not None
    auth = auth or NatsAuth()
    options = auth.connect_options()
    connecting = True
    last_error = ""

    async def on_error(e: Exception) -> None:
        violation = parse_permission_violation(e)
        if violation is not None:
            log.error(
                "nats permissions violation in %s (%s): %s to %r refused by the server",
                name,
                auth.describe(),
                violation.operation,
                violation.subject,
            )
            if on_permission_violation is not None:
                on_permission_violation(violation)
            return
        if "authorization violation" in str(e).lower() or isinstance(e, nats.errors.AuthorizationError):
            if connecting:
                # Raised out of the client's connect loop, which would otherwise retry forever.
                raise NatsAuthError(f"NATS at {url} refused the credentials of {name} ({auth.describe()})")
            log.error("nats refused the credentials of %s (%s) on reconnect", name, auth.describe())
            return
        if connecting and bounded:
            # A bounded first connection reports its failure once, as NatsUnreachableError.
            nonlocal last_error
            last_error = str(e) or type(e).__name__
            log.debug("nats error in %s while connecting: %s", name, e)
            return
        log.warning("nats error in %s: %s", name, e)

    async def on_disconnect() -> None:
        log.info("%s disconnected from nats", name)

    async def on_reconnect() -> None:
        log.info("%s reconnected to nats", name)

    options.update(
        connect_timeout=connect_timeout_s,
        max_reconnect_attempts=first_connect_retries if bounded else -1,
        reconnect_time_wait=0.25,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        pending_size=64 * 1024 * 1024,
        drain_timeout=5,
    )
    nc = CoalescingClient()
    try:
        await nc.connect(servers=url.split(","), name=name, **options)
    except nats.errors.NoServersError:
        if not nc.is_closed:
            await asyncio.shield(_close_quietly(nc))
        raise NatsUnreachableError(url, last_error) from None
    except BaseException:
        if not nc.is_closed:
            await asyncio.shield(_close_quietly(nc))
        raise
    finally:
        connecting = False
    # The bound was for the first connection only: a server lost later is waited for, as a
    # service does (the client's own request timeouts bound each call).
    nc.options["max_reconnect_attempts"] = -1
    return nc


async def _close_quietly(nc: Client) -> None:
    try:
        await nc.close()
    except Exception as e:  # the connection never fully opened
        log.debug("closing a failed nats connection: %s", e)


async def ensure_jetstream(js: JetStreamContext, replicas: int = 1) -> None:
    """Declare every stream and bucket SJA uses, each with ``replicas`` copies (``SJA_JS_REPLICAS``).

    Idempotent, and safe for services starting together: one that exists keeps its configuration,
    except that a stream or bucket with fewer replicas than asked is raised to ``replicas`` (a
    stream update; the servers copy its messages to the new peers while it keeps serving). So a
    deployment that moves from one server to a cluster restarts its services with the new setting
    and its state follows. Replicas are never lowered here: a service started with the default of
    one against a replicated cluster leaves the streams as they are.

    Raises ``JetStreamReplicasError`` when the servers cannot keep that many copies (a server not
    in a cluster, or fewer servers than replicas), naming the stream and what the server said.
    """
    if not 1 <= replicas <= MAX_REPLICAS:
        raise JetStreamReplicasError(f"JetStream replicas must be 1 to {MAX_REPLICAS}, not {replicas}")
    for spec in subjects.STREAMS:
        cfg = StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            retention=RetentionPolicy.WORK_QUEUE if spec.work_queue else RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=spec.duplicate_window_s,
            max_age=0 if spec.work_queue else 7 * DAY_S,
            max_bytes=spec.max_bytes,
            discard=DiscardPolicy.OLD,
            num_replicas=replicas,
        )
        try:
            info = await js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            await _declare(spec.name, replicas, js.add_stream(cfg))
            continue
        await _raise_replicas(js, info, replicas)
    for bucket in subjects.BUCKETS:
        try:
            info = await js.stream_info(f"KV_{bucket}")
        except nats.js.errors.NotFoundError:
            await _declare(
                bucket,
                replicas,
                js.create_key_value(
                    KeyValueConfig(bucket=bucket, history=5, replicas=replicas, storage=StorageType.FILE)
                ),
            )
            continue
        await _raise_replicas(js, info, replicas)


MAX_REPLICAS = 5
"""The most replicas a JetStream stream can have."""


class JetStreamReplicasError(ValueError):
    """The NATS servers cannot keep as many copies of SJA's streams and buckets as asked."""


async def _declare(name: str, replicas: int, declaring: Awaitable[Any]) -> None:
    try:
        await declaring
    except nats.js.errors.APIError as e:
        if replicas > 1 and _about_placement(e):
            raise _replicas_error(name, replicas, e) from None
        raise


def _about_placement(e: nats.js.errors.APIError) -> bool:
    """The server refused a stream for want of servers to place its copies on."""
    said = (e.description or "").lower()
    return e.err_code in PLACEMENT_ERRORS or any(w in said for w in ("replica", "peers", "cluster"))


PLACEMENT_ERRORS = frozenset({10005, 10023, 10074})
"""JetStream's error codes for "no suitable peers for placement", "insufficient resources" and
"replicas > 1 not supported in non-clustered mode"."""


async def _raise_replicas(js: JetStreamContext, info: Any, replicas: int) -> None:
    """Raise an existing stream to ``replicas`` copies (never lower it)."""
    cfg = info.config
    had = cfg.num_replicas or 1
    if had >= replicas:
        return
    log.info("raising the replicas of %s from %d to %d", cfg.name, had, replicas)
    cfg.num_replicas = replicas
    try:
        await js.update_stream(cfg)
    except nats.js.errors.APIError as e:
        if _about_placement(e):
            raise _replicas_error(cfg.name, replicas, e) from None
        raise
    except nats.errors.TimeoutError:
        # No answer: the user may not change streams (infra/nats/auth.conf lets services create
        # SJA's streams, not edit them; the refusal is logged as a permissions violation), or the
        # cluster has no JetStream leader at the moment.
        raise JetStreamReplicasError(
            f"SJA_JS_REPLICAS={replicas}: {cfg.name} has {had} copies and the "
            f"request to raise it got no answer. Where services connect as their own users they may "
            f"create SJA's streams but not change them: raise it as the operator "
            f"(nats stream edit {cfg.name} --replicas {replicas}), or start the service again once the "
            "cluster has a JetStream leader"
        ) from None


def _replicas_error(name: str, replicas: int, e: Exception) -> JetStreamReplicasError:
    said = getattr(e, "description", None) or str(e)
    return JetStreamReplicasError(
        f"SJA_JS_REPLICAS={replicas}: NATS cannot keep {replicas} copies of {name} (the server says: "
        f"{said}); {replicas} copies need a JetStream cluster of at least {replicas} servers (a single "
        "server: SJA_JS_REPLICAS=1)"
    )
