"""Connecting to NATS.

``connect`` takes the process's ``NatsSettings`` (``sja.bus.auth``: user and password or a password
file, a ``.creds`` file, an NKey seed file, TLS CA / client certificate and key, the reply inbox
prefix). With none of them it connects to an open server, which is what the embedded one-machine
stack and the tests use.

The server reports a publish or subscribe it refuses (``Permissions Violation``) without closing the
connection; ``connect`` logs each one at ERROR with the subject and hands it to the caller's
``on_permission_violation`` (``sja.bus.permissions``) so services can count them. A refused login
fails ``connect`` at once with ``NatsAuthError`` instead of retrying forever.

A service waits for its server as long as it takes (the default). A client (the CLI, ``SjaClient``)
passes ``first_connect_retries``: with no server at the URL, ``connect`` then fails within seconds
with ``NatsUnreachableError`` instead of retrying forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import nats
import nats.errors
from nats.aio.client import Client

from sja.bus.auth import NatsAuthError, NatsSettings
from sja.bus.natsclient import Client as CoalescingClient
from sja.bus.permissions import PermissionViolation, parse_permission_violation

log = logging.getLogger(__name__)


class NatsUnreachableError(ConnectionError):
    """No NATS server answered at the URL within the retries of a bounded first connection."""

    def __init__(self, url: str, last_error: str) -> None:
        super().__init__(f"no NATS server answers at {url}" + (f" ({last_error})" if last_error else ""))
        self.url = url


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    first_connect_retries: int | None = None,
    auth: NatsSettings | None = None,
    on_permission_violation: Callable[[PermissionViolation], None] | None = None,
) -> CoalescingClient:
    """Connect with unbounded reconnects: a restarted server is rejoined, not fatal.

    Credentials come from ``auth`` (a service's ``settings.nats``; none: an open server, as the dev
    stack runs). A server that refuses the credentials at the first connection fails this call with
    ``NatsAuthError``; bad options (a missing file, a password without user) fail with
    ``NatsConfigError`` before any I/O.

    Args:
        first_connect_retries: ``None`` retries the first connection forever (a service started
            before its server). A number ``n >= 1`` tries each server of ``url`` ``n + 1`` times,
            then fails with ``NatsUnreachableError`` (a client: the CLI must not hang). Once
            connected, reconnects are unbounded either way.
    """
    if first_connect_retries is not None and first_connect_retries < 1:
        raise ValueError("first_connect_retries must be at least 1 (None: retry forever)")
    bounded = first_connect_retries is not None
    auth = auth or NatsSettings()
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
