"""A ``command`` job's interpreter (``params.python``) and code (``params.code``): how they are
checked where the job is submitted, and how a subjob runs with them (``run_subjob``, as the slice's
actor runs it, in the real sandbox). ``sja.client`` (nats-py) is imported only by the tests of
``sja submit``'s checks: the rest runs without the NATS client."""

from __future__ import annotations

import io
import os
import stat
import sys
import zipfile
from pathlib import Path

import pytest

from sja.execution.code import CODE_AT
from sja.execution.commands import interpreter_first
from sja.execution.runner import completion_of, run_subjob
from sja.workloads import SpecError, codepack, workload
from sja.workloads.command import resolve_argv
from tests.unit.workloads.test_command import program, state_of, subjob

PRINTS_ITS_INTERPRETER = program(
    """
    import os, pathlib, sys
    out = pathlib.Path(os.environ["SJA_STATE_OUT"])
    (out / "executable").write_text(sys.executable)
    (out / "path").write_text(os.environ["PATH"])
    """
)[2]


def validate(**params: object) -> dict[str, object]:
    return workload("command").validate({"argv": ["true"], "units": 1, **params})


# --- the spec ----------------------------------------------------------------------------------


def test_a_job_without_interpreter_or_code_keeps_its_parameters() -> None:
    got = validate()
    assert "python" not in got and "code" not in got


@pytest.mark.parametrize("python", ["/opt/venv/bin/python", "/usr/bin/python3"])
def test_an_absolute_interpreter_is_taken(python: str) -> None:
    assert validate(python=python)["python"] == python


@pytest.mark.parametrize(
    "python", ["python3", "venv/bin/python", "/opt/../bin/python", "/opt/py/", 3, ["/x"]]
)
def test_an_interpreter_that_is_no_absolute_path_is_refused_naming_the_field(python: object) -> None:
    with pytest.raises(SpecError) as e:
        validate(python=python)
    assert e.value.field == "params.python" and "absolute path" in e.value.message


def test_code_is_taken_only_as_the_reference_of_an_upload() -> None:
    ref = "sha256:" + "a" * 64
    assert validate(code=ref)["code"] == ref
    for bad in ("./src", "sha256:abc", "sha256:" + "A" * 64, 5):
        with pytest.raises(SpecError) as e:
            validate(code=bad)
        assert e.value.field == "params.code" and "sja submit --code DIR" in e.value.message


def test_python_as_the_program_means_the_jobs_interpreter() -> None:
    assert resolve_argv(["python", "train.py"], "/opt/v/bin/python") == ["/opt/v/bin/python", "train.py"]
    assert resolve_argv(["python3", "-c", "x"], "/p") == ["/p", "-c", "x"]
    assert resolve_argv(["python3.11", "x"], "/p") == ["python3.11", "x"]
    assert resolve_argv(["bash", "python"], "/p") == ["bash", "python"]


def test_the_interpreters_directory_comes_first_on_path() -> None:
    assert interpreter_first("/opt/v/bin/python", "/usr/bin:/bin") == "/opt/v/bin:/usr/bin:/bin"
    assert (
        interpreter_first("/usr/bin/python3", "/usr/local/bin:/usr/bin:/bin")
        == "/usr/bin:/usr/local/bin:/bin"
    )
    assert interpreter_first("/usr/bin/python3", "/usr/bin:/bin") == "/usr/bin:/bin"


SPEC = "name: p\ntenant: t\nworkload: command\nparams: {{argv: [python, main.py], units: 3{extra}}}\n"


def test_sja_submit_refuses_an_interpreter_missing_here_naming_the_field(tmp_path: Path) -> None:
    from sja.client import SpecErrors, load_spec

    missing = tmp_path / "nowhere" / "python"
    with pytest.raises(SpecErrors) as e:
        load_spec(SPEC.format(extra=f", python: {missing}"), "job.yaml")
    assert e.value.problems == [
        f"job.yaml: params.python: {missing} does not exist here: name an interpreter installed where "
        "you submit and on every executor node, or leave it out for the executor's own"
    ]
    not_exe = tmp_path / "python"
    not_exe.write_text("")
    with pytest.raises(SpecErrors) as e:
        load_spec(SPEC.format(extra=f", python: {not_exe}"), "job.yaml")
    assert "params.python" in str(e.value) and "not an executable file" in str(e.value)
    with pytest.raises(SpecErrors) as e:
        load_spec(SPEC.format(extra=", python: bin/python"), "job.yaml")
    assert "job.yaml: params.python: expected the absolute path of an interpreter" in str(e.value)
    spec = load_spec(SPEC.format(extra=f", python: {sys.executable}"), "job.yaml")
    assert spec.params["python"] == sys.executable


def code_dir(tmp_path: Path) -> Path:
    d = tmp_path / "code"
    (d / "pkg").mkdir(parents=True)
    (d / "pkg" / "__init__.py").write_text("")
    (d / "pkg" / "helper.py").write_text("def answer():\n    return 42\n")
    (d / "main.py").write_text("from pkg.helper import answer\nprint(answer())\n")
    (d / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (d / "run.sh").chmod(0o700)
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref")
    return d


def test_a_code_directory_in_the_spec_is_packed_and_named_by_its_digest(tmp_path: Path) -> None:
    from sja.client import load_spec

    d = code_dir(tmp_path)
    archives: dict[str, bytes] = {}
    spec = load_spec(SPEC.format(extra=", code: code"), "job.yaml", base=tmp_path, archives=archives)
    ref = spec.params["code"]
    assert list(archives) == [ref] and ref == codepack.ref(codepack.digest(archives[ref]))
    names = zipfile.ZipFile(io.BytesIO(archives[ref])).namelist()
    assert names == ["main.py", "pkg/", "pkg/__init__.py", "pkg/helper.py", "run.sh"]
    # --code wins over the spec, and gives the same bytes for the same files.
    again: dict[str, bytes] = {}
    spec2 = load_spec(SPEC.format(extra=", code: elsewhere"), "job.yaml", code=d, archives=again)
    assert spec2.params["code"] == ref and again == archives


def test_code_that_cannot_be_packed_is_refused_naming_where(tmp_path: Path) -> None:
    from sja.client import SpecErrors, load_spec

    with pytest.raises(SpecErrors) as e:
        load_spec(SPEC.format(extra=", code: nothing-here"), "job.yaml", base=tmp_path)
    assert e.value.problems == [f"job.yaml: params.code: {tmp_path / 'nothing-here'} is not a directory"]
    with pytest.raises(SpecErrors) as e:
        load_spec("name: m\ntenant: t\nworkload: matmul\n", "m.yaml", code=tmp_path)
    assert "m.yaml: --code: only a command job takes code" in str(e.value)


# --- the archive -------------------------------------------------------------------------------


def zip_of(*members: tuple[str, bytes, int]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            z.writestr(info, data)
    return buf.getvalue()


def test_packing_is_deterministic_and_keeps_only_the_owners_execute_bit(tmp_path: Path) -> None:
    d = code_dir(tmp_path)
    first = codepack.pack(d, 1 << 20)
    os.utime(d / "main.py", (1, 1))
    assert codepack.pack(d, 1 << 20) == first
    modes = {i.filename: i.external_attr >> 16 for i in zipfile.ZipFile(io.BytesIO(first)).infolist()}
    assert modes["run.sh"] == stat.S_IFREG | 0o755 and modes["main.py"] == stat.S_IFREG | 0o644
    assert codepack.check(first, 1 << 20) > 0
    with pytest.raises(codepack.CodeError, match="packs to more than"):
        codepack.pack(d, 100)


@pytest.mark.parametrize(
    ("archive", "why"),
    [
        (b"not a zip", "not a zip archive"),
        (zip_of(("../evil.py", b"x", stat.S_IFREG | 0o644)), "stay inside"),
        (zip_of(("/etc/evil", b"x", stat.S_IFREG | 0o644)), "stay inside"),
        (zip_of(("link", b"/etc/passwd", stat.S_IFLNK | 0o777)), "not a regular file"),
        (zip_of(("suid", b"x", stat.S_IFREG | 0o4755)), "set-uid"),
        (zip_of(("a", b"x", 0o644), ("a/", b"", stat.S_IFDIR | 0o755)), "appears twice"),
        (zip_of(("big", b"\0" * 200_000, stat.S_IFREG | 0o644)), "unpacks to more than"),
    ],
)
def test_an_archive_that_is_no_acceptable_code_is_refused(archive: bytes, why: str) -> None:
    with pytest.raises(codepack.CodeError, match=why):
        codepack.check(archive, 100_000)


def test_an_unpacked_tree_is_made_readable_by_all_and_writable_by_its_owner_only(tmp_path: Path) -> None:
    t = tmp_path / "t"
    (t / "d").mkdir(parents=True)
    (t / "d" / "f").write_text("x")
    (t / "d" / "f").chmod(0o4700)
    (t / "g").write_text("y")
    (t / "g").chmod(0o600)
    (t / "d").chmod(0o700)
    os.symlink("/etc/passwd", t / "link")
    codepack.normalize(t)
    assert stat.S_IMODE((t / "d").stat().st_mode) == 0o755
    assert stat.S_IMODE((t / "d" / "f").stat().st_mode) == 0o755
    assert stat.S_IMODE((t / "g").stat().st_mode) == 0o644
    assert not (t / "link").is_symlink()


# --- a subjob ----------------------------------------------------------------------------------


def test_python_runs_the_executors_own_interpreter_by_default_and_is_first_on_path() -> None:
    r = run_subjob(subjob({"argv": ["python", "-c", PRINTS_ITS_INTERPRETER], "units": 3}))
    assert r.status == "ok", r.error
    got = state_of(r.output)
    assert got["executable"] == sys.executable
    assert got["path"].split(":")[0] == os.path.dirname(sys.executable)


def test_python_runs_the_interpreter_the_job_names(tmp_path: Path) -> None:
    # Another path to an interpreter (a link, as a virtual environment's bin/python is).
    named = tmp_path / "venv" / "bin" / "python"
    named.parent.mkdir(parents=True)
    named.symlink_to(os.path.realpath(sys.executable))
    for p in (tmp_path, tmp_path / "venv", named.parent):
        p.chmod(0o755)
    # /tmp is hidden from subjobs: an interpreter there is refused; elsewhere it runs.
    argv = ["python3", "-c", PRINTS_ITS_INTERPRETER]
    r = run_subjob(subjob({"argv": argv, "units": 3, "python": str(named)}))
    if str(named).startswith("/tmp/"):
        assert r.status == "failed" and r.final, r.error
        assert r.error.startswith(f"params.python: {named} lies where subjobs on node")
    else:
        assert r.status == "ok", r.error
        assert state_of(r.output)["executable"] == str(named)
    # The interpreter this virtual environment was made from (not the executor's own).
    real = os.path.realpath(sys.executable)
    assert real != sys.executable
    r = run_subjob(subjob({"argv": argv, "units": 3, "python": real}))
    assert r.status == "ok", r.error
    assert state_of(r.output)["executable"] == real


def test_an_interpreter_the_node_lacks_fails_the_job_at_once_saying_so() -> None:
    sj = subjob({"argv": ["python", "main.py"], "units": 3, "python": "/opt/no-such-venv/bin/python"})
    r = run_subjob(sj)
    assert r.status == "failed" and r.final
    assert r.error.startswith("params.python: /opt/no-such-venv/bin/python does not exist on node ")
    assert "install it on every executor node" in r.error
    c = completion_of(sj, r)
    assert c.final and c.status == "failed"


def test_a_subjob_runs_in_its_code_read_only_with_it_on_pythonpath(tmp_path: Path) -> None:
    d = code_dir(tmp_path)
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(io.BytesIO(codepack.pack(d, 1 << 20))) as z:
        z.extractall(unpacked)
    codepack.normalize(unpacked)
    for p in (tmp_path,):
        p.chmod(0o700)  # the sandbox shows the code directory itself, whatever holds it
    body = """
    import os, pathlib, subprocess, sys
    from pkg.helper import answer
    out = pathlib.Path(os.environ["SJA_STATE_OUT"])
    (out / "answer").write_text(str(answer()))
    (out / "cwd").write_text(os.getcwd() + " " + os.environ["SJA_CODE_DIR"])
    (out / "sub").write_text(subprocess.run(["python", "main.py"], capture_output=True, text=True).stdout)
    try:
        open("new-file", "w")
        (out / "write").write_text("written")
    except OSError as e:
        (out / "write").write_text(type(e).__name__)
    """
    import textwrap

    r = run_subjob(
        subjob({"argv": ["python", "-c", textwrap.dedent(body)], "units": 3, "code": "sha256:" + "0" * 64}),
        code_dir=str(unpacked),
    )
    assert r.status == "ok", r.error + r.stderr
    got = state_of(r.output)
    assert got["answer"] == "42" and got["sub"] == "42\n"
    assert got["cwd"] == f"{CODE_AT} {CODE_AT}"
    assert got["write"] in ("OSError", "PermissionError")
    assert not (unpacked / "new-file").exists()


def test_python_in_merge_argv_is_the_jobs_interpreter_where_it_is_installed_here() -> None:
    from sja.results import merge_python

    real = os.path.realpath(sys.executable)
    assert merge_python({"python": real}) == real
    assert merge_python({"python": "/opt/no-such-venv/bin/python"}) == sys.executable
    assert merge_python({}) == sys.executable
