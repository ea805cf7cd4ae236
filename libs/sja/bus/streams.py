"""Declaring the JetStream streams and KV buckets SJA uses, with as many copies as asked
(``SJA_JS_REPLICAS``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from sja.protocol import subjects

log = logging.getLogger(__name__)

DAY_S = 86_400.0
MIB = 1024 * 1024


async def object_store(
    js: JetStreamContext, bucket: str, description: str, replicas: int, max_mib: float
) -> Any:
    """The object store ``bucket``, created when missing with ``replicas`` copies and at most
    ``max_mib`` MiB in all (0: no limit)."""
    try:
        return await js.object_store(bucket)
    except Exception:
        limit = int(max_mib * MIB)
        return await js.create_object_store(
            bucket,
            ObjectStoreConfig(
                description=description, replicas=replicas, max_bytes=limit if limit > 0 else None
            ),
        )


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
