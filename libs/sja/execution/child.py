"""A Python workload's subjob, in its sandbox: ``python -m sja.execution.child REQUEST RESULT``.

Started by the slice's actor (``sja.execution.runner.run_sandboxed``) inside the subjob's sandbox;
reads the request (``ChildRequest``: the subjob and when it started) from ``REQUEST``, runs it with
``run_workload`` (the workload's code is imported here, never in the actor) and writes the
``RunResult`` to ``RESULT`` (msgpack). ``SIGTERM`` (the deadline) asks the workload to stop
(``sja.job`` context's ``should_stop``).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import msgspec

from sja import job
from sja.execution.runner import ChildRequest, run_workload


def _stop(_sig: int, _frame: FrameType | None) -> None:
    ctx = job.current()
    if ctx is not None:
        ctx.request_stop()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m sja.execution.child REQUEST RESULT", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        request = msgspec.msgpack.decode(f.read(), type=ChildRequest)
    signal.signal(signal.SIGTERM, _stop)
    sj = msgspec.structs.replace(request.subjob, input_checkpoint=request.checkpoint)
    result = run_workload(sj, started=request.started)
    tmp = argv[1] + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.msgpack.encode(result))
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
