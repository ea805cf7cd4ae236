"""State archives (``sja.workloads.statetar``) extract safely on every Python 3.11: each hostile
archive a tenant's program could leave is tried against both mechanisms (``tarfile``'s ``data``
filter where this Python has it, and the member checks used where it does not, 3.11.0-3.11.3) and
refused, with nothing written outside the directory; a good state makes the round trip through both.

The oldest Python at hand (Debian 12's ``/usr/bin/python3`` is 3.11.2, which has no ``data``
filter) runs the same checks in a process of its own, and a sequential ``command`` job's state in
and out (``pack_state``, ``Command.run`` twice, ``unpack_state``) with a real program."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from sja.workloads import statetar

ROOT = Path(__file__).resolve().parents[3]
OLD_PYTHON = Path("/usr/bin/python3")

MECHANISMS = [
    pytest.param(False, id="member-checks"),
    pytest.param(
        True,
        id="data-filter",
        marks=pytest.mark.skipif(not statetar.HAS_DATA_FILTER, reason="this Python has no data filter"),
    ),
]


def archive(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def hostile(outside: Path) -> dict[str, bytes]:
    """Archives that try to write ``outside`` (a path beside the directory) or a special file."""
    rel = f"../{outside.name}"
    return {
        "dot-dot name": archive((entry(rel), b"pwned")),
        "nested dot-dot": archive((entry(f"a/b/../../{rel}"), b"pwned")),
        "symlink out, then a file through it": archive(
            (entry("out", tarfile.SYMTYPE, str(outside.parent)), b""),
            (entry(f"out/{outside.name}"), b"pwned"),
        ),
        "relative symlink out": archive((entry("up", tarfile.SYMTYPE, f"../{outside.name}"), b"")),
        "absolute symlink": archive((entry("etc", tarfile.SYMTYPE, "/etc"), b"")),
        "hard link out": archive((entry("pw", tarfile.LNKTYPE, "/etc/passwd"), b"")),
        "hard link dot-dot": archive((entry("pw", tarfile.LNKTYPE, rel), b"")),
        "character device": archive((entry("null", tarfile.CHRTYPE), b"")),
        "block device": archive((entry("disk", tarfile.BLKTYPE), b"")),
        "fifo": archive((entry("pipe", tarfile.FIFOTYPE), b"")),
    }


@pytest.mark.parametrize("data_filter", MECHANISMS)
def test_every_hostile_archive_is_refused_and_writes_nothing_outside(
    tmp_path: Path, data_filter: bool
) -> None:
    outside = tmp_path / "outside"
    for why, data in hostile(outside).items():
        dest = tmp_path / f"dest-{len(list(tmp_path.iterdir()))}"
        dest.mkdir()
        # The archive does hold the member that would escape: the attack is really tried.
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            assert tar.getmembers(), why
        with pytest.raises(statetar.UnsafeArchive):
            statetar.extract(data, dest, data_filter=data_filter)
        assert not outside.exists(), why
        assert not any(
            p.is_symlink() and not p.resolve().is_relative_to(dest.resolve()) for p in dest.rglob("*")
        )
        assert not any(p.is_char_device() or p.is_block_device() or p.is_fifo() for p in dest.rglob("*")), why


@pytest.mark.parametrize("data_filter", MECHANISMS)
def test_an_absolute_name_lands_inside(tmp_path: Path, data_filter: bool) -> None:
    outside = tmp_path / "outside"
    dest = tmp_path / "dest"
    dest.mkdir()
    statetar.extract(archive((entry(str(outside)), b"pwned")), dest, data_filter=data_filter)
    assert not outside.exists()
    assert (dest / str(outside).lstrip("/")).read_bytes() == b"pwned"


@pytest.mark.parametrize("data_filter", MECHANISMS)
def test_a_state_makes_the_round_trip_with_its_modes_made_safe(tmp_path: Path, data_filter: bool) -> None:
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "weights.bin").write_bytes(os.urandom(4096))
    (src / "sub" / "deeper" / "step").write_text("42")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "latest").symlink_to("sub/deeper/step")
    data = statetar.pack(src)
    # Set-uid and group/other-writable modes a program could leave: extracted without them.
    bad_modes = archive((entry("suid", mode=0o6777), b"x"), (entry("shared", mode=0o666), b"y"))
    dest = tmp_path / "dest"
    dest.mkdir()
    statetar.extract(data, dest, data_filter=data_filter)
    statetar.extract(bad_modes, dest, data_filter=data_filter)
    assert (dest / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    assert (dest / "sub" / "deeper" / "step").read_text() == "42"
    assert os.readlink(dest / "latest") == "sub/deeper/step" and (dest / "latest").read_text() == "42"
    assert os.access(dest / "run.sh", os.X_OK)
    assert stat.S_IMODE((dest / "suid").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "shared").stat().st_mode) == 0o644
    assert (dest / "suid").stat().st_uid == os.geteuid()


def test_without_the_data_filter_the_member_checks_are_what_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on 3.11.0-3.11.3: ``tarfile`` has no ``data_filter``, so ``extract`` checks each member
    itself (it never passes ``filter=``, which those versions reject)."""
    monkeypatch.setattr(statetar, "HAS_DATA_FILTER", False)
    seen: list[str] = []
    check: Callable[[tarfile.TarInfo, str], tarfile.TarInfo] = statetar.safe_member

    def spy(member: tarfile.TarInfo, root: str) -> tarfile.TarInfo:
        seen.append(member.name)
        return check(member, root)

    monkeypatch.setattr(statetar, "safe_member", spy)
    dest = tmp_path / "d"
    dest.mkdir()
    statetar.extract(archive((entry("ok"), b"1")), dest)
    assert seen == ["ok"] and (dest / "ok").read_text() == "1"
    with pytest.raises(statetar.UnsafeArchive):
        statetar.extract(archive((entry("../escaped"), b"1")), dest)
    assert not (tmp_path / "escaped").exists()


def old_python() -> str:
    """``/usr/bin/python3`` when it is a 3.11 older than 3.11.4 (no ``data`` filter); else skip."""
    if not OLD_PYTHON.exists():
        pytest.skip("no /usr/bin/python3")
    got = subprocess.run(
        [str(OLD_PYTHON), "-c", "import sys; print(*sys.version_info[:3])"], capture_output=True, text=True
    )
    version = tuple(int(x) for x in got.stdout.split())
    if version[:2] != (3, 11) or version >= (3, 11, 4):
        pytest.skip(f"/usr/bin/python3 is {'.'.join(map(str, version))}: not a 3.11 without the data filter")
    return str(OLD_PYTHON)


def run_old(code: str, tmp_path: Path, *, site_packages: bool) -> str:
    """``code`` under the old Python with ``libs`` on its path, and (``site_packages``) the
    dependencies of this environment (built for the same 3.11 ABI), which that Python lacks."""
    paths = [str(ROOT / "libs")]
    if site_packages:
        import msgspec

        paths.append(str(Path(msgspec.__file__).parents[1]))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(paths)}
    r = subprocess.run(
        [old_python(), "-I" if not site_packages else "-s", "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_oldest_python_refuses_hostile_archives_with_the_standard_library_alone(tmp_path: Path) -> None:
    """The tar helper alone (standard library only, loaded by path: no other SJA module, none of its
    dependencies) under /usr/bin/python3: no data filter there, every hostile archive refused."""
    cases = hostile(tmp_path / "outside")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for i, data in enumerate(cases.values()):
        (blobs / f"{i}.tar").write_bytes(data)
    out = run_old(
        f"""
        import importlib.util, pathlib, sys
        path = {str(ROOT / "libs/sja/workloads/statetar.py")!r}
        spec = importlib.util.spec_from_file_location("statetar", path)
        statetar = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(statetar)
        assert not statetar.HAS_DATA_FILTER, sys.version
        assert "msgspec" not in sys.modules
        tmp = pathlib.Path({str(tmp_path)!r})
        refused = 0
        for blob in sorted((tmp / "blobs").iterdir()):
            dest = tmp / ("dest-" + blob.stem)
            dest.mkdir()
            try:
                statetar.extract(blob.read_bytes(), dest)
            except statetar.UnsafeArchive:
                refused += 1
        src = tmp / "src"
        (src / "a").mkdir(parents=True)
        (src / "a" / "f").write_text("state")
        statetar.extract(statetar.pack(src), tmp / "back")
        print(refused, (tmp / "back" / "a" / "f").read_text(), sys.version_info[:3] < (3, 11, 4))
        """,
        tmp_path,
        site_packages=False,
    )
    assert out.split() == [str(len(cases)), "state", "True"]
    assert not (tmp_path / "outside").exists()


def test_the_oldest_python_runs_a_sequential_command_jobs_state_in_and_out(tmp_path: Path) -> None:
    """``pack_state``/``unpack_state`` and two subjobs of a sequential ``command`` job under
    /usr/bin/python3 (3.11.2 failed every such job: ``extractall`` had no ``filter``): the second
    subjob reads the state the first left, and the final state unpacks."""
    out = run_old(
        f"""
        import pathlib, sys
        import sja.execution.commands  # the run of a command job (in its sandbox)
        from sja.workloads import statetar
        from sja.workloads.command import Command, StateSummary, pack_state, unpack_state
        assert not statetar.HAS_DATA_FILTER, sys.version
        tmp = pathlib.Path({str(tmp_path)!r})
        program = (
            "import os, pathlib\\n"
            "e = os.environ\\n"
            "i, o = pathlib.Path(e['SJA_STATE_IN']), pathlib.Path(e['SJA_STATE_OUT'])\\n"
            "total = int((i / 'n').read_text()) if (i / 'n').exists() else 0\\n"
            "(o / 'n').write_text(str(total + int(e['SJA_UNITS'])))\\n"
        )
        job = Command()
        params = job.validate({{"argv": [sys.executable, "-c", program], "units": 10}})
        first = job.run(params, 0, 4, b"")
        last = job.run(params, 4, 6, first)
        summary = unpack_state(last, tmp / "final")
        src = tmp / "src"
        src.mkdir()
        (src / "x").write_text("y")
        packed = pack_state(src, StateSummary(unit_start=0, unit_end=3, files=1))
        again = unpack_state(packed, tmp / "again")
        print(summary.unit_end, (tmp / "final" / "n").read_text())
        print(again.unit_end, (tmp / "again" / "x").read_text())
        """,
        tmp_path,
        site_packages=True,
    )
    assert out.split() == ["10", "10", "3", "y"]
