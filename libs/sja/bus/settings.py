"""Settings as ``msgspec.Struct`` built from a mapping (``SJA_*`` environment variables)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound="BaseSettings")

PREFIX = "SJA_"


class SettingsError(ValueError):
    pass


class BaseSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Settings every service shares. Each field ``x`` reads from ``SJA_X``."""

    nats_url: str = "nats://127.0.0.1:4222"
    out_dir: str = "out"
    instance: str = ""
    """Replica id; defaults to ``<service>-<host>-<pid>``."""
    log_level: str = "INFO"
    drain_timeout_s: float = 10.0

    @classmethod
    def from_env(cls: type[S], env: Mapping[str, str] | None = None, **overrides: Any) -> S:
        env = os.environ if env is None else env
        raw: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            key = PREFIX + name.upper()
            if key in env:
                raw[name] = env[key]
        raw.update(overrides)
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as e:
            raise SettingsError(f"bad setting for {cls.__name__}: {e}") from None
