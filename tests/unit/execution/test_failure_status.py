"""How a subjob that failed outside its workload is classified: out of memory, or failed."""

from __future__ import annotations

import ray.exceptions

from sja.execution.runner import failure_status


def test_engine_out_of_memory_errors_are_oom() -> None:
    assert failure_status(ray.exceptions.OutOfMemoryError("node running low on memory")) == "oom"
    assert failure_status(ray.exceptions.OutOfMemoryError("")) == "oom", "by its class, whatever it says"
    assert failure_status(MemoryError()) == "oom"
    assert failure_status(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "oom"


def test_a_worker_killed_by_the_memory_monitor_is_oom() -> None:
    died = ray.exceptions.ActorDiedError()
    assert failure_status(died) == "failed", "an actor that died of something else"

    class Died(ray.exceptions.RayActorError):
        def __str__(self) -> str:
            return (
                "The actor died. Worker exit detail: Task was killed due to the node running low on memory."
            )

    assert failure_status(Died()) == "oom"


def test_a_wrapped_cause_is_looked_at() -> None:
    wrapped = ray.exceptions.RayTaskError("run", "Traceback ...", MemoryError())
    assert failure_status(wrapped) == "oom"
    plain = ray.exceptions.RayTaskError("run", "Traceback ...", ValueError("bad input"))
    assert failure_status(plain) == "failed"
    outer = RuntimeError("actor call failed")
    outer.__cause__ = MemoryError()
    assert failure_status(outer) == "oom"


def test_other_failures_are_failed() -> None:
    for e in (
        ray.exceptions.NodeDiedError("node gone"),
        ray.exceptions.WorkerCrashedError(),
        ValueError("out of memory"),  # not an allocation failure: a workload's own message
        RuntimeError("shape mismatch"),
    ):
        assert failure_status(e) == "failed", e
