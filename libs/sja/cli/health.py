"""Container health check: is this container's SJA service serving?

    python -m sja.cli.health <service> [--timeout SECONDS] [--any]

Connects to NATS with the same settings as the service (``SJA_NATS_URL`` and the ``SJA_NATS_*``
credentials, so it runs in the service's container with nothing else to configure), sends the NATS
micro discovery ping ``$SRV.PING.sja-<service>`` and waits for the answer of *this* replica: the one
whose ``metadata.instance`` is ``SJA_INSTANCE``, or, when that is unset, the default id
``<service>-<hostname>-<pid>`` of a process on this host (a container's hostname is its own, so with
``docker compose up --scale agent=3`` each agent container checks itself, not any agent). ``--any``
accepts any replica of the service instead.

A service answers discovery only once it is serving (``Service.start`` registers it last), so this is a
readiness check. Exit status 0: healthy; 1: not (the reason on stderr); 2: bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence

from sja.bus.auth import NatsAuthError, NatsConfigError
from sja.bus.connection import connect
from sja.bus.settings import BaseSettings, SettingsError

SERVICES = ("inventory", "advertiser", "clearer", "agent", "executor", "gateway", "ui")


class Unhealthy(Exception):
    pass


def expected_instance(service: str, settings: BaseSettings) -> tuple[str, bool]:
    """The instance id to look for and whether it is a prefix (the default id ends with a pid)."""
    if settings.instance:
        return settings.instance, False
    return f"{service}-{socket.gethostname()}-", True


async def check(service: str, settings: BaseSettings, timeout_s: float, any_replica: bool) -> str:
    """The instance id of the replica that answered; ``Unhealthy`` when none that counts did."""
    deadline = time.monotonic() + timeout_s
    try:
        nc = await asyncio.wait_for(
            connect(
                settings.nats_url,
                f"sja-health-{service}",
                connect_timeout_s=max(0.5, timeout_s / 2),
                auth=settings.nats.for_service(service),
            ),
            timeout=timeout_s,
        )
    except TimeoutError:
        raise Unhealthy(f"cannot reach NATS at {settings.nats_url} within {timeout_s:.1f}s") from None
    except (NatsAuthError, NatsConfigError) as e:
        raise Unhealthy(str(e)) from None
    want, prefix = expected_instance(service, settings)
    seen: list[str] = []
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"$SRV.PING.sja-{service}", b"", reply=inbox)
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            with contextlib.suppress(ValueError, KeyError, TypeError):
                instance = str(json.loads(msg.data)["metadata"]["instance"])
                seen.append(instance)
                if any_replica or instance == want or (prefix and instance.startswith(want)):
                    return instance
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    if not seen:
        raise Unhealthy(f"no sja-{service} answered $SRV.PING.sja-{service} within {timeout_s:.1f}s")
    looked_for = f"an instance starting with {want!r}" if prefix else f"instance {want!r}"
    raise Unhealthy(f"sja-{service} answered from {', '.join(sorted(seen))}, not from {looked_for}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sja.cli.health", description=__doc__.split("\n\n")[0])
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default 3)")
    parser.add_argument("--any", action="store_true", help="accept any replica of the service")
    args = parser.parse_args(argv)
    # Only what makes the check fail is worth a line (a permissions violation is logged at ERROR).
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = BaseSettings.from_env(os.environ)
    except SettingsError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    try:
        instance = asyncio.run(check(args.service, settings, args.timeout, args.any))
    except Unhealthy as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    print(f"sja-{args.service} {instance} is serving")
    return 0


if __name__ == "__main__":
    sys.exit(main())
