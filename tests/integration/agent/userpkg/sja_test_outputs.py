"""Workloads of the tests of ``test_sequential_checkpoints.py`` that misbehave in their results. A
Python workload runs in its subjob's sandboxed process, which imports it by ``module:attr``: this
directory is put on ``PYTHONPATH`` by those tests."""

from __future__ import annotations

from typing import Any, ClassVar

from sja.protocol import messages as m


class BigOutput:
    """A workload whose every subjob returns 2 MiB of output, not as a checkpoint blob."""

    name: ClassVar[str] = "big-output"
    sequential: ClassVar[bool] = False
    framework: ClassVar[str] = "numpy"

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        return params

    def total_units(self, params: dict[str, Any]) -> int:
        return 4

    def declared_memory(self, params: dict[str, Any]) -> m.MemoryDecl:
        return m.MemoryDecl(base_mib=8, per_unit_mib=1)

    def declared_time(self, params: dict[str, Any]) -> m.TimeDecl:
        return m.TimeDecl(warmup_s=0, per_unit_s=0.01)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        return bytes(2 * 1024 * 1024)

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        return acc

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        return {}


class HugeResult(BigOutput):
    """A workload whose result holds an int past 64 bits: MessagePack cannot encode it."""

    name: ClassVar[str] = "huge-result"

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        return b"x"

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        return {"n": 2**70}
