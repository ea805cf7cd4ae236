"""Settings as ``msgspec.Struct`` built from the environment (``SJA_*`` variables), validated once.

``Settings.from_env(env)`` reads each field ``x`` from ``SJA_X`` of the mapping it is given (a
process passes ``os.environ``; a test passes a dict). A field that is itself a settings group (a
``msgspec.Struct``, as ``BaseSettings.nats``) reads its fields ``y`` from ``SJA_X_Y``. Lists and
mappings are written as text and parsed here, before validation, so a bad value fails when the
settings are built, with a message naming its variable, rather than in a handler later:

- a tuple, list or set field: comma-separated items (``SJA_POOLS=rack-a,rack-b``);
- a mapping field: comma-separated ``key=value`` pairs (``SJA_TENANT_SHARES=alpha=3,beta=1``).

A group's field named ``mode`` is read from the group's own variable (``SJA_SANDBOX=off`` sets
``sandbox.mode``).

The typed aliases below (``Pools``, ``Nodes``, ``TenantShares``, ``TenantBudgets``, ``Weights3``)
are the settings every service reading them shares.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import msgspec.inspect as mi

from sja.bus.auth import NatsSettings

S = TypeVar("S", bound="BaseSettings")

PREFIX = "SJA_"

Name = Annotated[str, msgspec.Meta(min_length=1)]
Pools = tuple[Name, ...]
"""Pool names (``SJA_POOLS=a,b``); empty: every pool."""
Nodes = tuple[Name, ...]
"""Node names (``SJA_NODES=a,b``); empty: every node."""
TenantShares = dict[Name, Annotated[float, msgspec.Meta(gt=0)]]
"""``tenant=weight,...``: each tenant's target share, a positive weight."""
TenantBudgets = dict[Name, Annotated[float, msgspec.Meta(ge=0)]]
"""``tenant=credits,...``: each tenant's budget, zero or more (an unlisted tenant: unlimited)."""
Weight = Annotated[float, msgspec.Meta(ge=0)]
Weights3 = tuple[Weight, Weight, Weight]
"""Three non-negative weights (``0.5,0.3,0.2``)."""


class SettingsError(ValueError):
    pass


class BaseSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Settings every service shares. Each field ``x`` reads from ``SJA_X``."""

    nats_url: str = "nats://127.0.0.1:4222"
    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    """NATS credentials, TLS files and reply inbox prefix (``SJA_NATS_USER`` and the others; all
    optional; empty: an open server, as the one-machine stack runs). ``connect`` takes them."""
    out_dir: str = "out"
    instance: str = ""
    """Replica id; defaults to ``<service>-<host>-<pid>``."""
    log_level: str = "INFO"
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The process's event loop (``sja.bus.service.run_loop``): uvloop, or the standard one."""
    drain_timeout_s: float = 10.0
    js_replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    """Copies of every stream and bucket the service declares (``ensure_jetstream``): 3 on a
    JetStream cluster of three servers or more keeps every job, grant and completion through the
    loss of one; existing ones with fewer are raised to it, never lowered."""
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of the Prometheus ``/metrics`` endpoint (``sja.telemetry.metrics``); 0: no endpoint."""

    @classmethod
    def from_env(cls: type[S], env: Mapping[str, str], **overrides: Any) -> S:
        """These settings from ``env`` (``SJA_*``), then ``overrides`` (field name -> value; a
        string for a list or mapping field is parsed as the variable would be).

        Raises ``SettingsError`` naming the variable of the first value that is not valid."""
        info = _struct_info(cls)
        raw: dict[str, Any] = {}
        for field in info.fields:
            group = _group(field.type)
            if group is not None:
                sub = {
                    f.name: _parse(env[key], f.type, key)
                    for f in group.fields
                    if (key := _group_variable(field.name, f.name)) in env
                }
                if sub:
                    raw[field.name] = sub
                continue
            key = _variable(field.name)
            if key in env:
                raw[field.name] = _parse(env[key], field.type, key)
        for name, value in overrides.items():
            field_type = next((f.type for f in info.fields if f.name == name), None)
            if isinstance(value, str) and field_type is not None:
                value = _parse(value, field_type, _variable(name))
            raw[name] = value
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as e:
            raise SettingsError(f"bad setting {_named(str(e))}for {cls.__name__}: {e}") from None

    @classmethod
    def variables(cls) -> Iterator[tuple[str, Any]]:
        """Every variable these settings read, with the default of its field (a settings group's
        fields included, each under its own variable)."""
        for field in _struct_info(cls).fields:
            group = _group(field.type)
            if group is None:
                yield _variable(field.name), _default(field)
                continue
            for sub in group.fields:
                yield _group_variable(field.name, sub.name), _default(sub)


def _variable(*path: str) -> str:
    return PREFIX + "_".join(path).upper()


def _group_variable(group: str, name: str) -> str:
    """A group's field: ``SJA_<GROUP>_<FIELD>``, but its field ``mode`` is the group's own variable
    (``SJA_SANDBOX=off`` for ``sandbox.mode``)."""
    return _variable(group) if name == GROUP_MODE else _variable(group, name)


GROUP_MODE = "mode"


def _struct_info(cls: type[msgspec.Struct]) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


def _default(field: mi.Field) -> Any:
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return field.default


def _group(t: mi.Type) -> mi.StructType | None:
    return t if isinstance(t, mi.StructType) else None


def _collection(t: mi.Type) -> mi.Type:
    """A field's type without its constraints' wrapper (``Annotated`` with ``Meta``)."""
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _parse(text: str, t: mi.Type, variable: str) -> Any:
    """A variable's text as the value its field's type takes before validation: the text itself,
    or its items (a sequence) or pairs (a mapping)."""
    t = _collection(t)
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.TupleType | mi.SetType | mi.FrozenSetType):
        return [p.strip() for p in text.split(",") if p.strip()]
    if isinstance(t, mi.DictType):
        pairs: dict[str, str] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq:
                raise SettingsError(f"bad setting {variable}: {part!r} is not key=value (in {text!r})")
            pairs[key.strip()] = value.strip()
        return pairs
    return text


_PATH = re.compile(r"`\$\.([A-Za-z0-9_.]+)")


def _named(message: str) -> str:
    """``SJA_X `` for a validation error at ``$.x`` (``SJA_X_Y`` at ``$.x.y``), else nothing."""
    found = _PATH.search(message)
    return f"{_variable(*found.group(1).split('.'))} " if found else ""
