"""SJA's own words: validation errors, all of them at once, and ranges of units (``unit_range``).

msgspec stops at the first problem of a message and words it for programmers (``Expected `int`,
got `str` - at `$.max_parallel```). A person who wrote a job spec wants every problem of the file
in one go, each naming its field in the spec's own terms (``max_parallel: must be a whole number,
not text``). ``struct_problems`` checks a mapping against a struct one field at a time (nested
structs field by field too) and ``plain`` rewords one msgspec message.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from sja.protocol.messages import ID_PATTERN, NAME_PATTERN, token_fields

_KINDS = {
    "int": "a whole number",
    "float": "a number",
    "str": "text",
    "bool": "true or false",
    "object": "a mapping",
    "array": "a list",
    "null": "empty (null)",
    "bytes": "bytes",
}

_BOUNDS = {"<=": "at most", ">=": "at least", "<": "less than", ">": "more than"}


def _kind(name: str) -> str:
    return _KINDS.get(name, name)


def plain(message: str, choices: tuple[object, ...] = ()) -> str:
    """One msgspec validation message (its ``- at `$.path``` part removed) in plain words; a
    message of another form is returned as it is."""
    message = re.sub(r"\s*- at `\$[^`]*`$", "", message)
    m = re.fullmatch(r"Expected `([a-z]+)`, got `([a-z]+)`", message)
    if m:
        return f"must be {_kind(m[1])}, not {_kind(m[2])}"
    m = re.fullmatch(r"Expected `([a-z]+)` of length (<=|>=) (\d+)", message)
    if m:
        if m[2] == ">=" and m[3] == "1":
            return "must not be empty"
        return f"must be {_BOUNDS[m[2]]} {m[3]} characters long"
    m = re.fullmatch(r"Expected `([a-z]+)` (<=|>=|<|>) (\S+)", message)
    if m:
        return f"must be {_kind(m[1])} {_BOUNDS[m[2]]} {_number(m[3])}"
    m = re.fullmatch(r"Expected `str` matching regex '(.*)'", message)
    if m:
        what = "dot-separated words" if m[1] == ID_PATTERN else "one word"
        return f"must be {what} of letters, digits, '_' and '-'"
    m = re.fullmatch(r"Invalid enum value (.*)", message)
    if m:
        known = ", ".join(str(c) for c in choices)
        return f"{m[1]} is not one of {known}" if known else f"{m[1]} is not an accepted value"
    m = re.fullmatch(r"Object contains unknown field `(.*)`", message)
    if m:
        return f"unknown field {m[1]!r}"
    m = re.fullmatch(r"Object missing required field `(.*)`", message)
    if m:
        return f"missing required field {m[1]!r}"
    return message


def unit_range(start: int, count: int) -> str:
    """A range of units as every view writes it (``sja status``, ``sja logs``, the dashboard).

    A range is half-open, ``[start, start + count)``, numbered from 0 as ``SJA_UNIT_START`` is; it is
    written as its first and last unit, both included, joined by a hyphen, then the number of
    units in brackets: ``0-7 (8)`` is units 0 to 7, eight of them; ``5 (1)`` is unit 5 alone; a
    range of no unit is ``none from 5 (0)``. The count makes the notation unambiguous: the last
    unit is ``start + count - 1``, never ``start + count``."""
    if count <= 0:
        return f"none from {start} (0)"
    if count == 1:
        return f"{start} (1)"
    return f"{start}-{start + count - 1} ({count})"


def _number(text: str) -> str:
    try:
        v = float(text)
    except ValueError:
        return text
    return f"{v:g}"


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    """The struct a field holds (``S`` or ``S | None``), or ``None``."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        structs = [a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, msgspec.Struct)]
        if len(structs) == 1:
            return structs[0]
    return None


def _range(tp: Any) -> str:
    """The bounds of a constrained number field in words (``more than 0 and less than 0.5``)."""
    parts = []
    for arg in typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,):
        if typing.get_origin(arg) is typing.Annotated:
            for meta in typing.get_args(arg)[1:]:
                if isinstance(meta, msgspec.Meta):
                    for attr, word in (("gt", "more than"), ("ge", "at least"), ("lt", "less than"),
                                       ("le", "at most")):  # fmt: skip
                        bound = getattr(meta, attr)
                        if bound is not None:
                            parts.append(f"{word} {bound:g}")
    return " and ".join(parts)


def _choices(tp: Any) -> tuple[object, ...]:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if c := _choices(a):
                return c
    return ()


def struct_problems(raw: Any, cls: type[msgspec.Struct], prefix: str = "") -> list[tuple[str, str]]:
    """Every problem of ``raw`` as a ``cls``, as (field path, message) pairs in the order of the
    struct's fields (unknown fields last); empty when ``msgspec.convert(raw, cls)`` would pass the
    checks of each field (the struct's own checks across fields are not made here)."""
    if not isinstance(raw, Mapping):
        return [(prefix.rstrip(".") or "spec", f"must be a mapping, not {_kind(_json_kind(raw))}")]
    out: list[tuple[str, str]] = []
    fields = msgspec.structs.fields(cls)
    ids, names, _ = token_fields(cls)
    for f in fields:
        path = f"{prefix}{f.encode_name}"
        if f.encode_name not in raw:
            if f.required:
                out.append((path, "missing (required)"))
            continue
        value = raw[f.encode_name]
        nested = _struct_of(f.type)
        if nested is not None and isinstance(value, Mapping):
            out.extend(struct_problems(value, nested, f"{path}."))
            continue
        try:
            msgspec.convert(value, f.type)
        except msgspec.ValidationError as e:
            bounds = _range(f.type)
            if bounds and re.match(r"Expected `(int|float)` (<=|>=|<|>) ", str(e)):
                out.append((path, f"must be {bounds}, not {value!r}"))
            else:
                out.append((path, plain(str(e), _choices(f.type))))
            continue
        pattern = ID_PATTERN if f.name in ids else NAME_PATTERN if f.name in names else None
        if pattern is not None and isinstance(value, str) and re.fullmatch(pattern, value) is None:
            out.append((path, plain(f"Expected `str` matching regex {pattern!r}")))
    known = {f.encode_name for f in fields}
    forbid = getattr(cls, "__struct_config__", None)
    if forbid is not None and forbid.forbid_unknown_fields:
        for key in raw:
            if key not in known:
                out.append((f"{prefix}{key}", f"unknown field (known: {', '.join(sorted(known))})"))
    return out


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__
