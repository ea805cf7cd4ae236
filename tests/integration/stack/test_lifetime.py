"""A local stack's processes live no longer than the stack: one dropped without ``stop`` (its owner
interrupted, a test that timed out in its teardown) takes its services and its nats-server with it
when it is collected, and no ``Popen`` is left to warn that its process still runs."""

from __future__ import annotations

import gc
import os
import warnings
from pathlib import Path

from sja.stack import LocalStack
from tests.integration.waits import wait_until_sync


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie not yet reaped counts as gone: what matters is that it no longer runs.
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_dropped_stack_takes_its_processes_with_it(tmp_path: Path) -> None:
    stack = LocalStack(out_dir=tmp_path)
    stack.start_nats()
    service = stack.spawn("inventory")
    assert stack.nats is not None and stack.nats.proc is not None
    pids = [service.proc.pid, stack.nats.proc.pid]
    assert all(alive(p) for p in pids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del stack, service
        gc.collect()
    wait_until_sync(lambda: not any(alive(p) for p in pids), "the stack's processes to end", timeout_s=10)
