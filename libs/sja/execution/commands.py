"""Running a ``command`` job's subjob: its program in a sandbox, under the ``command`` contract.

The contract itself (validation, the state archive, merge and finalize) is ``sja.workloads.command``;
this is the executor's side: a private work directory (``state_in``, ``state_out``, ``report.json``)
owned by the sandbox uid, the contract's variables pointing into it as the program sees it
(``/tmp/sja-work`` inside its sandbox), an environment built from an allow-list, the program run in
its sandbox (``sja.execution.program``), its report and state read back without trusting what it
left (no link followed, no special file read), and warm continuation (``sja.execution.warm``).
"""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import socket
import stat
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from sja import job
from sja.execution import sandbox as sbx
from sja.execution import stopclock
from sja.execution import warm as warm_reg
from sja.execution.program import Running, last_lines, start_program, watch
from sja.workloads import checkpoint as ckpt
from sja.workloads import command
from sja.workloads.command import OOM_MARKERS, StateSummary, summary_of, unpack_state

REPORT_MAX_BYTES = 1024 * 1024
_enc = msgspec.msgpack.Encoder()


def mem_cap_bytes(mem_cap_mib: float, cuda_visible_devices: str, extra_mib: float = 0.0) -> float:
    """The resident memory past which a subjob is stopped as ``oom`` on an emulated slice (one with
    no device: its memory is the host's); 0 on a real device, whose own memory holds the cap."""
    if cuda_visible_devices or mem_cap_mib <= 0:
        return 0.0
    margin = sbx.current().settings.mem_margin
    return (mem_cap_mib * (1 + margin) + extra_mib) * 1024 * 1024


def _work_paths(work: Path) -> tuple[Path, Path, Path]:
    return work / "state_in", work / "state_out", work / "report.json"


def _fresh(work: Path, box: sbx.Sandbox) -> None:
    """Empty the work directory's contract paths for a range (a warm program's next one).

    A warm program is alive while this runs, as the owner of the work directory: nothing here
    follows a link it may have put there, and nothing is changed below a name it controls (only
    ``work`` itself, which lies in the executor's private directory, is resolved as a path)."""
    state_in, state_out, report = _work_paths(work)
    for path in (state_in, state_out, report):
        _remove(path)
    for d in (state_in, state_out):
        d.mkdir(mode=0o700)
        box.own(d, recursive=False)
    box.own(work, recursive=False)


def _remove(path: Path) -> None:
    """Remove ``path`` (a directory tree, a file or a link) without following links."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)  # never follows a link (it works on directory descriptors)


def _restore_into(checkpoint: bytes, state_in: Path, box: sbx.Sandbox) -> StateSummary:
    """Unpack a state as ``state_in``: into a directory of the executor's own first, given to the
    sandbox uid there, then put in place by one rename (a live program sees it whole, and cannot
    turn the executor's writes elsewhere)."""
    staging = Path(tempfile.mkdtemp(prefix="staging-", dir=box.root()))
    try:
        (staging / "state").mkdir(mode=0o700)
        before = unpack_state(checkpoint, staging / "state")
        box.own(staging / "state")
        _remove(state_in)
        os.rename(staging / "state", state_in)  # replaces a link or file left there, never follows it
        return before
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def pack_dir(directory: Path, summary: StateSummary) -> bytes:
    """``pack_state`` for a directory a live program may still change: walked by directory
    descriptors (``os.fwalk``), each file opened without following a link, so that no link makes the
    executor read outside it; links are kept as links."""
    buf = io.BytesIO()
    entries: list[tuple[str, tarfile.TarInfo, bytes | None]] = []
    for root, dirs, files, rootfd in os.fwalk(directory, follow_symlinks=False):
        rel = os.path.relpath(root, directory)
        for name in sorted(dirs) + sorted(files):
            arc = name if rel == "." else f"{rel}/{name}"
            try:
                st = os.stat(name, dir_fd=rootfd, follow_symlinks=False)
            except OSError:
                continue
            info = tarfile.TarInfo(arc)
            info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
            data: bytes | None = None
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
            elif stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=rootfd)
            elif stat.S_ISREG(st.st_mode):
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=rootfd)
                except OSError:
                    continue
                with os.fdopen(fd, "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        continue
                    data = f.read()
                info.size = len(data)
            else:
                continue  # a FIFO, a device, a socket: not state
            entries.append((arc, info, data))
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for _, info, data in sorted(entries, key=lambda e: e[0]):
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return ckpt.pack_blob(_enc.encode(summary), buf.getvalue())


def run_command(params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
    """Run one range of a ``command`` job (``Command.run``): its output state checkpoint."""
    ctx = job.current()
    if ctx is None:  # run outside an executor (the one-piece reference): no deadline
        ctx = job.Context(
            job_id="local",
            subjob_id="local",
            unit_start=unit_start,
            count=units,
            total_units=params["units"],
        )
    box = sbx.current()
    python = params.get("python") or sys.executable
    if params.get("python"):
        why = interpreter_problem(python, box)
        if why:
            raise job.Stopped("failed", f"params.python: {why}", final=True)
    argv = command.resolve_argv(params["argv"], python)
    sequential = command.Command().is_sequential(params)
    warm = bool(params.get("warm")) and sequential
    held = warm_reg.take(ctx.job_id, ctx.slice_id) if warm else None
    in_digest = warm_reg.state_digest(checkpoint) if held is not None else ""
    # The parked process already holds the state this subjob starts from: nothing to read.
    resumed = held is not None and bool(in_digest) and held.digest == in_digest
    keep: Running | None = None
    if held is not None and held.running.work is not None:
        work = held.running.work  # the parked program sees this directory: its next range uses it
    else:
        work = box.workdir(f"{ctx.job_id}-{ctx.subjob_id}")
    try:
        _fresh(work, box)
        state_in, state_out, report = _work_paths(work)

        def restore() -> None:
            try:
                before = _restore_into(checkpoint, state_in, box)
            except ValueError as e:
                raise job.Stopped("failed", f"input state unreadable: {e}") from None
            except OSError as e:
                raise job.Stopped("failed", f"input state not put in place: {e}") from None
            if before.unit_end != unit_start:
                raise job.Stopped(
                    "failed",
                    f"input state ends at unit {before.unit_end}, the subjob starts at unit {unit_start}",
                )

        if checkpoint and sequential:
            if resumed:
                held_end = summary_of(checkpoint).unit_end
                if held_end != unit_start:
                    raise job.Stopped(
                        "failed",
                        f"input state ends at unit {held_end}, the subjob starts at unit {unit_start}",
                    )
            else:
                restore()
        now = time.time()
        # An open subjob (``core.continuation``) has no deadline: it runs until it is asked to
        # yield, which moves its clock (``SliceActor.yield_subjob``); ``SJA_DEADLINE`` says where its
        # window ends, past which it may go on.
        clock = stopclock.get(ctx.subjob_id) if ctx.continues else None
        if clock is not None:
            deadline = clock.window_end or now
        else:
            deadline = ctx.deadline if math.isfinite(ctx.deadline) else now + 10 * 365 * 86400
        # Never before the planned start-up and first unit (``core.stopping.stop_grace``, in the context).
        grace = min(ctx.stop_grace_s, max(0.0, deadline - now))
        cuda = ctx.cuda_visible_devices or os.environ.get("CUDA_VISIBLE_DEVICES", "")
        contract = {
            "SJA_JOB_ID": ctx.job_id,
            "SJA_SUBJOB_ID": ctx.subjob_id,
            "SJA_UNIT_START": str(unit_start),
            "SJA_UNITS": str(units),
            "SJA_TOTAL_UNITS": str(params["units"]),
            "SJA_ATTEMPT": str(ctx.attempt),
            "SJA_STATE_IN": box.inside(work, state_in),
            "SJA_STATE_OUT": box.inside(work, state_out),
            "SJA_REPORT": box.inside(work, report),
            "SJA_DEADLINE": f"{deadline:.3f}",
            "SJA_STOP_GRACE_S": f"{grace:.3f}",
            "SJA_CONTINUE": "1" if clock is not None else "0",
            "SJA_MEM_CAP_MIB": str(ctx.mem_cap_mib),
            "SJA_SLICE_ID": ctx.slice_id,
            "CUDA_VISIBLE_DEVICES": cuda,
        }
        code = ctx.code_dir or None
        cwd = params["cwd"] or None
        if code is not None:
            seen = box.code_at(code)
            contract["SJA_CODE_DIR"] = seen
            own = params["env"].get("PYTHONPATH", "")
            contract["PYTHONPATH"] = seen + (os.pathsep + own if own else "")
            cwd = os.path.join(seen, cwd) if cwd else seen  # a relative cwd lies in the code
        env = sbx.environment(contract, params["env"], box.settings.env, home=box.home(work))
        env["PATH"] = interpreter_first(python, env["PATH"])
        nvml, device = nvml_for(cuda)
        running = None
        if held is not None:
            if held.running.send({"env": contract, "resumed": resumed}):
                running = held.running
            else:  # it died since: start afresh, from the state
                held.running.work = None  # its directory is this range's now
                held.running.kill()
                if resumed and checkpoint:
                    restore()
                resumed = False
        try:
            if running is None:
                running = start_program(argv, env, sandbox=box, work=work, cwd=cwd, warm=warm, code=code)
        except OSError as e:
            raise job.Stopped("failed", f"cannot start {argv[0]!r}: {e}") from None
        except sbx.SandboxError as e:
            raise job.Stopped("failed", str(e)) from None
        keep = running
        r = watch(
            running,
            term_at=deadline - grace,
            kill_at=deadline,
            nvml=nvml,
            device_uuid=device,
            mem_cap_bytes=mem_cap_bytes(ctx.mem_cap_mib, cuda),
            clock=clock,
        )
        yielded = clock is not None and clock.yielded_at > 0
        if not r.alive:
            keep = None
        handed = held is not None and running is held.running
        if warm:
            ctx.warm = "resumed" if resumed else ("handed" if handed else "cold")
        ctx.stdout_tail, ctx.stderr_tail = r.stdout, r.stderr
        reported = read_report(report)
        torch_peak = reported.get("torch_cuda_peak_mib", 0.0)
        ctx.peak_mem_mib = max(r.peak_mem_mib, torch_peak if isinstance(torch_peak, int | float) else 0.0)
        tail = last_lines(r.stderr) or last_lines(r.stdout)
        if r.over_cap_mib:
            raise job.Stopped(
                "oom",
                f"stopped: its processes' resident memory {r.over_cap_mib:.1f} MiB exceeded the slice's "
                f"{ctx.mem_cap_mib} MiB. Last output:\n{tail}",
            )
        if r.signalled == "kill" and yielded:
            assert clock is not None
            raise job.Stopped(
                "timeout",
                f"asked to yield (another job won the slice {clock.yielded_at - now:.1f}s after it "
                f"started) and still running {clock.kill_at - clock.yielded_at:.1f}s later: killed; the "
                f"units it had not reported are planned again. Last output:\n{tail}",
            )
        if r.signalled == "kill":
            raise job.Stopped(
                "timeout",
                f"still running at the window's end ({deadline - now:.1f}s after it started; SIGTERM "
                f"was sent {grace:.1f}s before): killed. Last output:\n{tail}",
            )
        said = reported.get("units_done")
        if (
            r.signalled == "term"
            and r.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)
            and (not isinstance(said, int) or isinstance(said, bool))
        ):
            # SJA's own stop signal ended it before it said it had done anything: the window was too
            # short for its start-up, not a failure of the program (its time profile learns).
            if yielded:
                assert clock is not None
                raise job.Stopped(
                    "timeout",
                    f"asked to yield (another job won the slice {clock.yielded_at - now:.1f}s after it "
                    "started), it ended on SIGTERM without reporting a unit done: the units it did are "
                    "planned again. A program that continues past its window must stop at a unit "
                    "boundary on SIGTERM (docs/jobs.md). Last output:\n" + tail,
                )
            raise job.Stopped(
                "timeout",
                f"stopped by SJA's SIGTERM {grace:.1f}s before the window's end, before it reported "
                f"a unit done (its start-up and first unit were planned at {ctx.first_unit_s:.1f}s of "
                f"a {deadline - now:.1f}s window): the window was too short. Last output:\n{tail}",
            )
        if r.returncode != 0:
            if r.returncode == -signal.SIGXFSZ:
                raise job.Stopped(
                    "failed",
                    f"killed by signal 25 (SIGXFSZ): a file passed the sandbox's size limit of "
                    f"{box.settings.fsize_mib} MiB. Last stderr lines:\n{tail}",
                )
            oom = r.returncode == -9 or any(m in r.stderr for m in OOM_MARKERS)
            how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exited with {r.returncode}"
            raise job.Stopped("oom" if oom else "failed", f"{how}. Last stderr lines:\n{tail}")
        done = reported.get("units_done", units)
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= units:
            raise job.Stopped("failed", f"{report.name}: units_done must be 0 to {units}, got {done!r}")
        if done == 0:
            if yielded:
                raise job.Stopped("timeout", "asked to yield before its first unit was done")
            raise job.Stopped("timeout", "stopped before its first unit was done")
        ctx.units_done = done
        if state_out.is_symlink() or not state_out.is_dir():
            raise job.Stopped("failed", "SJA_STATE_OUT was replaced by something not a directory")
        files = sum(len(d) + len(f) for _, d, f, _ in os.fwalk(state_out, follow_symlinks=False))
        if files == 0 and sequential:
            raise job.Stopped("failed", "exited 0 but left no state in SJA_STATE_OUT")
        summary = StateSummary(
            unit_start=unit_start,
            unit_end=unit_start + done,
            files=files,
            metrics=command.clean_metrics(reported.get("metrics", {})),
        )
        out = pack_dir(state_out, summary)
        if keep is not None:
            warm_reg.park(ctx.job_id, ctx.slice_id, keep, warm_reg.state_digest(out))
            keep = None
            work = None  # type: ignore[assignment]  # the parked program keeps it
        return out
    finally:
        if keep is not None:  # the range did not end well: the process goes, with its directory
            keep.kill()
        if work is not None:
            sbx.remove_workdir(work)


def interpreter_problem(path: str, box: sbx.Sandbox) -> str:
    """Why the interpreter a job names (``params.python``) cannot run its subjobs on this node, or
    ``""``."""
    node = socket.gethostname()
    if not os.path.exists(path):
        return (
            f"{path} does not exist on node {node}: install it on every executor node, or leave "
            f"params.python out for the executor's own ({sys.executable})"
        )
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return f"{path} on node {node} is not an executable file"
    if not box.sees(path):
        return (
            f"{path} lies where subjobs on node {node} do not see (under /tmp, the executor's HOME, "
            "/root or a path in SJA_SANDBOX_HIDE): install it elsewhere"
        )
    return ""


def interpreter_first(python: str, path: str) -> str:
    """``PATH`` with the interpreter's directory first (as a virtual environment's ``activate``
    does): its ``python``, ``pip`` and scripts are the ones a program finds."""
    where = os.path.dirname(python)
    entries = [e for e in path.split(os.pathsep) if e]
    if not where or entries[:1] == [where]:
        return path
    return os.pathsep.join([where, *(e for e in entries if e != where)])


def read_report(path: Path) -> dict[str, Any]:
    """A program's report, read without following a link or opening anything but a regular file."""
    import json

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > REPORT_MAX_BYTES:
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            got = json.loads(f.read(REPORT_MAX_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return got if isinstance(got, dict) else {}


def nvml_for(device: str) -> tuple[Any, str]:
    """NVML and the device to sample a subjob's GPU memory on (none on an emulated slice)."""
    if not device or os.environ.get("SJA_SLICE_SOURCE", "") in ("", "declared") or device.isdigit():
        return None, ""
    try:
        from sja.inventory.nvml import load_nvml

        return load_nvml(), device
    except Exception:
        return None, ""


command.set_runner(run_command)

__all__ = [
    "interpreter_first",
    "interpreter_problem",
    "mem_cap_bytes",
    "nvml_for",
    "pack_dir",
    "read_report",
    "run_command",
]
