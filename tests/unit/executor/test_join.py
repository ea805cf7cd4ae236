"""The executor joining an existing Ray cluster tries again a connection that failed (a head still
starting, or its Ray Client server failing to start one under load), and gives up after a bound."""

from __future__ import annotations

from pathlib import Path

import pytest

import services.executor.raylife as executor_module
from services.executor.raylife import RAY_JOIN_ATTEMPTS
from services.executor.service import ExecutorService, ExecutorSettings


def joining(
    tmp_path: Path, failures: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[ExecutorService, list[str]]:
    calls: list[str] = []

    def init(address: str, **_kw: object) -> None:
        calls.append(address)
        if len(calls) <= failures:
            raise ConnectionAbortedError(
                "Initialization failure from server: Starting Ray client server failed"
            )

    monkeypatch.setattr(executor_module.ray, "init", init)
    monkeypatch.setattr(executor_module.ray, "shutdown", lambda: None)
    monkeypatch.setattr(executor_module.time, "sleep", lambda _s: None)
    settings = ExecutorSettings(
        nats_url="nats://127.0.0.1:1", out_dir=str(tmp_path), ray_address="ray://head:10001"
    )
    return ExecutorService(settings), calls


def test_a_failed_join_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, calls = joining(tmp_path, 2, monkeypatch)
    svc._join_ray()
    assert calls == ["ray://head:10001"] * 3


def test_joining_gives_up_after_its_attempts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, calls = joining(tmp_path, 100, monkeypatch)
    with pytest.raises(ConnectionAbortedError):
        svc._join_ray()
    assert len(calls) == RAY_JOIN_ATTEMPTS
