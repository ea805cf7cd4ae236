"""Settings as ``msgspec.Struct`` built from a mapping (``SJA_*`` environment variables)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

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
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The process's event loop (``sja.bus.service.run_loop``): uvloop, or the standard one."""
    drain_timeout_s: float = 10.0
    js_replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    """Copies of every stream and bucket the service declares (``ensure_jetstream``): 3 on a
    JetStream cluster of three servers or more keeps every job, grant and completion through the
    loss of one; existing ones with fewer are raised to it, never lowered."""
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of the Prometheus ``/metrics`` endpoint (``sja.telemetry.metrics``); 0: no endpoint."""
    # NATS credentials (all optional; empty: an open server, as the one-machine stack runs).
    nats_user: str = ""
    nats_password: str = ""
    nats_password_file: str = ""
    """A file holding the password (a mounted secret); use it or ``nats_password``, not both."""
    nats_creds: str = ""
    """A NATS ``.creds`` file (JWT + NKey seed) for servers in operator mode."""
    nats_nkey_seed: str = ""
    """A file holding an NKey seed, for servers that list users by NKey."""
    nats_tls_ca: str = ""
    """CA bundle for the server's certificate (``tls://`` URLs use the system store without it)."""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    """Client certificate and key, for servers that verify clients."""
    nats_inbox_prefix: str = ""
    """Reply inbox prefix; empty: ``_INBOX.<nats_user>`` (what ``infra/nats/auth.conf`` allows)."""

    def __repr__(self) -> str:
        """Like the default, with the password masked (settings end up in logs and tracebacks)."""
        fields = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name == "nats_password" and value:
                value = "***"
            fields.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(fields)})"

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
