"""Typed encode/decode of wire messages (MessagePack), failing with a clear error."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()


class DecodeError(ValueError):
    """A payload that is not a valid message of the expected type."""

    def __init__(self, expected: str, detail: str) -> None:
        super().__init__(f"invalid {expected}: {detail}")
        self.expected = expected
        self.detail = detail
        self.field = _field_of(detail)


def _field_of(detail: str) -> str:
    # msgspec reports paths as "... - at `$.spec.tenant`". A check of a struct's own (its
    # ``__post_init__``: ``sja.protocol.messages.Tokens``) names the field, and msgspec adds the
    # struct's path after it: "... - at `$.node` - at `$.offers[0].window`".
    marker = "at `$."
    paths = [part.split("`", 1)[0] for part in detail.split(marker)[1:]]
    if len(paths) >= 2:
        return f"{paths[-1]}.{paths[0]}"
    return paths[0] if paths else ""


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


@cache
def _decoder(typ: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(typ)


def decode(data: bytes, typ: type[T], max_bytes: int | None = MAX_MESSAGE_BYTES) -> T:
    """Decode ``data`` as ``typ``; raise ``DecodeError`` naming the type and the bad field.

    ``max_bytes`` bounds what is read from the bus; ``None`` for payloads that never travel on it
    (a slice actor's result, whose checkpoint may be far larger: it goes to the object store).
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise DecodeError(_name(typ), f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        result: T = _decoder(typ).decode(data)  # type: ignore[arg-type]
    except msgspec.ValidationError as e:
        raise DecodeError(_name(typ), str(e)) from None
    except msgspec.DecodeError as e:
        raise DecodeError(_name(typ), f"malformed payload ({e})") from None
    return result


def decode_union(data: bytes, typ: Any) -> Any:
    """Decode a tagged union (``A | B``) of message types."""
    return decode(data, typ)


def _name(typ: Any) -> str:
    return str(getattr(typ, "__name__", typ))


def to_builtins(msg: Any) -> Any:
    return msgspec.to_builtins(msg)
