"""The executor's Ray: joining a cluster (``SJA_RAY_ADDRESS``) or starting a local one for the node,
and checking that the cluster holds the node's slices."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import ray

from sja.execution.actor import node_resource

log = logging.getLogger(__name__)

RAY_JOIN_ATTEMPTS = 5
"""Tries to join an existing Ray cluster (``SJA_RAY_ADDRESS``) before the executor gives up."""


def join_ray(address: str) -> None:
    """Join the Ray cluster at ``address``, trying again a connection that failed: a head still
    starting, or the head's Ray Client server failing to start one for this client (it has a
    start-up deadline a loaded head can miss). The last failure is raised."""
    delay = 1.0
    for attempt in range(1, RAY_JOIN_ATTEMPTS + 1):
        try:
            ray.init(address=address, namespace="sja", log_to_driver=False)
            return
        except (ConnectionError, RuntimeError) as e:
            if attempt == RAY_JOIN_ATTEMPTS:
                raise
            log.warning(
                "joining Ray at %s failed (attempt %d of %d): %s",
                address,
                attempt,
                RAY_JOIN_ATTEMPTS,
                str(e).strip().splitlines()[-1][:200] if str(e).strip() else repr(e),
            )
            with contextlib.suppress(Exception):
                ray.shutdown()
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def init_ray(node: str, address: str, num_cpus: int, resources: dict[str, float]) -> bool:
    """Ray for ``node``'s slices (``resources``): the cluster at ``address``, else a local one that
    declares them. Whether actors also take a share of the node's resource (``sja_node:<node>``)."""
    if ray.is_initialized():
        return check_cluster(node, resources)
    if address:
        join_ray(address)
        return check_cluster(node, resources)
    kwargs: dict[str, Any] = {}
    if num_cpus:
        kwargs["num_cpus"] = num_cpus
    with without_secrets():  # the local Ray's processes (its workers too) start without them
        ray.init(
            address="local",  # never join some other Ray cluster running on this machine
            namespace="sja",
            resources=resources,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=128 * 1024 * 1024,
            **kwargs,
        )
    return True


def check_cluster(node: str, wanted: dict[str, float]) -> bool:
    """Fail at start, not at the first subjob, when the cluster lacks this node's slices; whether it
    declares the node's own resource."""
    have = ray.cluster_resources()  # type: ignore[no-untyped-call]
    missing = sorted(r for r in wanted if r.startswith("sja_slice:") and r not in have)
    if missing:
        raise RuntimeError(
            f"the Ray cluster has no resource {', '.join(missing)}: start node {node!r} with "
            f"ray start --address=... --resources='{json.dumps(wanted)}' "
            f"(sja inventory --node {node} --ray-resources prints it)"
        )
    return node_resource(node) in have


SECRET_MARKERS = ("PASSWORD", "TOKEN", "SECRET", "CREDS", "NKEY", "_KEY")
"""Parts of a variable's name that make it a secret the local Ray's processes start without."""


def is_secret(name: str) -> bool:
    """Whether a variable of the executor's environment must stay out of Ray's processes: the
    service's NATS settings and anything named like a credential, except Ray's own (its auth token
    is how its processes reach each other; subjobs never see it: their environment is allow-listed)."""
    upper = name.upper()
    if upper.startswith("RAY_"):
        return False
    return upper.startswith("SJA_NATS_") or any(m in upper for m in SECRET_MARKERS)


@contextlib.contextmanager
def without_secrets() -> Iterator[None]:
    """This process's environment without its secrets (``is_secret``) while a child inherits it
    (the local Ray's GCS and raylet, whose workers inherit theirs); put back afterwards."""
    taken = {k: os.environ.pop(k) for k in list(os.environ) if is_secret(k)}
    try:
        yield
    finally:
        os.environ.update(taken)
