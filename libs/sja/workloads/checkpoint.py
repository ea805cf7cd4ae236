"""Large checkpoints: a workload's output as a small summary plus a blob kept in an object store.

A sequential workload (training) returns ``pack_blob(summary, data)``: ``summary`` is what the job's
state needs to read (step, loss; a few bytes), ``data`` the model and optimizer state (megabytes).
The executor puts ``data`` in the JetStream object store ``sja-checkpoints`` and sends on a
``BlobRef`` (bucket, name, size, digest, summary) in its place, so completions and job state stay
small; before the next subjob runs it fetches the blob back and hands the actor the full checkpoint.
Functions here only encode and decode; the object store I/O is the executor's.
"""

from __future__ import annotations

import hashlib

import msgspec

BUCKET = "sja-checkpoints"
"""The JetStream object store holding checkpoint blobs."""

_BLOB = b"SJA-BLOB1\n"
_REF = b"SJA-BREF1\n"


class Blob(msgspec.Struct, frozen=True, array_like=True):
    summary: bytes
    data: bytes


class BlobRef(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str
    name: str
    size: int
    sha256: str
    summary: bytes = b""


_blob_dec = msgspec.msgpack.Decoder(Blob)
_ref_dec = msgspec.msgpack.Decoder(BlobRef)
_enc = msgspec.msgpack.Encoder()


def pack_blob(summary: bytes, data: bytes) -> bytes:
    return _BLOB + _enc.encode(Blob(summary, data))


def is_blob(raw: bytes) -> bool:
    return raw.startswith(_BLOB)


def is_ref(raw: bytes) -> bool:
    return raw.startswith(_REF)


def unpack_blob(raw: bytes) -> Blob:
    if not is_blob(raw):
        raise ValueError("not a checkpoint blob")
    return _blob_dec.decode(raw[len(_BLOB) :])


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_ref(bucket: str, name: str, blob: Blob) -> bytes:
    ref = BlobRef(
        bucket=bucket, name=name, size=len(blob.data), sha256=digest(blob.data), summary=blob.summary
    )
    return _REF + _enc.encode(ref)


def unpack_ref(raw: bytes) -> BlobRef:
    if not is_ref(raw):
        raise ValueError("not a checkpoint reference")
    return _ref_dec.decode(raw[len(_REF) :])


def summary_of(raw: bytes) -> bytes:
    """The summary of a checkpoint, inline or referenced; empty for no checkpoint."""
    if not raw:
        return b""
    if is_ref(raw):
        return unpack_ref(raw).summary
    return unpack_blob(raw).summary


def where(raw: bytes) -> str:
    """``bucket/name`` of a referenced checkpoint, ``inline`` otherwise, empty for none."""
    if not raw:
        return ""
    if is_ref(raw):
        ref = unpack_ref(raw)
        return f"{ref.bucket}/{ref.name}"
    return "inline"


MIB = 1024 * 1024
TENANT_TAG = "sja-state tenant="
"""How a stored state's object description names its tenant (``tenant_of``): what the per-tenant
quota counts the store by."""


def describe(tenant: str) -> str:
    """The description a state's object is stored with."""
    return f"{TENANT_TAG}{tenant}"


def tenant_of(description: str | None) -> str:
    """The tenant a stored object was described with (``describe``); empty if none."""
    return description[len(TENANT_TAG) :] if description and description.startswith(TENANT_TAG) else ""


def refusal(size: int, held: int | None, tenant: str, state_max_mib: float, tenant_max_mib: float) -> str:
    """Why a state of ``size`` bytes is not stored, or ``""`` when it may be: over the limit per
    state (``state_max_mib``), or over the tenant's limit with the ``held`` bytes of states it has
    in the store already (``tenant_max_mib``; ``held`` is ``None`` when not counted). A limit of 0
    is none."""
    if state_max_mib > 0 and size > state_max_mib * MIB:
        return (
            f"its state is {size / MIB:.1f} MiB, over the limit of {state_max_mib:g} MiB per state "
            f"(SJA_STATE_MAX_MIB): leave less state"
        )
    if held is not None and tenant_max_mib > 0 and held + size > tenant_max_mib * MIB:
        return (
            f"tenant {tenant} holds {held / MIB:.1f} MiB of states already; this one ({size / MIB:.1f} "
            f"MiB) would pass its limit of {tenant_max_mib:g} MiB (SJA_TENANT_STATE_MAX_MIB): the "
            f"operator removes finished jobs' states from the object store {BUCKET}"
        )
    return ""
