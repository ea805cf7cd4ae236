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
