"""The job commands: ``sja submit``, ``status``, ``jobs``, ``cancel``, ``trace``, ``explain``,
``logs`` and ``result``, each a question to the gateway (``sja.client``).

Each asks through ``with_client``: one connection per command, with the credentials of its options
and the ``SJA_NATS_*`` environment, closed once answered; a server or gateway that cannot be reached
(or that refuses the credentials) is one line on stderr and exit 2. ``sja.cli.main`` registers the
commands on ``sja``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import msgspec
import typer

from sja.cli.output import JsonOpt, console, err_console, fail, fail_all, output_closed, print_json

if TYPE_CHECKING:
    from sja.client import SjaClient

T = TypeVar("T")

JobArg = Annotated[str, typer.Argument(metavar="JOB", help="A job id (`sja jobs` lists them).")]

NatsOpt = Annotated[
    str,
    typer.Option("--nats", envvar="SJA_NATS_URL", metavar="URL", help="NATS server URL of the stack."),
]
DEFAULT_NATS = "nats://127.0.0.1:4222"
UserOpt = Annotated[
    str,
    typer.Option(
        "--user", envvar="SJA_NATS_USER", metavar="USER", help="NATS user (a tenant's or the operator's)."
    ),
]
PasswordOpt = Annotated[
    str,
    typer.Option(
        "--password",
        envvar="SJA_NATS_PASSWORD",
        metavar="PASSWORD",
        help="NATS password (prefer the env var or SJA_NATS_PASSWORD_FILE to the command line).",
    ),
]
TenantOpt = Annotated[
    str,
    typer.Option(
        "--tenant",
        envvar="SJA_TENANT",
        metavar="TENANT",
        help="Act as this tenant: use its own API subjects (required with a tenant's credentials).",
    ),
]


def client_auth(env: Mapping[str, str], user: str = "", password: str = "") -> Any:
    """The CLI's credentials, found as ``kubectl`` finds its kubeconfig: ``--user``/``--password``
    (or ``SJA_NATS_USER``/``SJA_NATS_PASSWORD``), else the credentials file of ``--credentials`` or
    ``SJA_NATS_CREDENTIALS``, else the one ``sja up`` writes (``~/.config/sja/credentials.json``)
    if it exists; with none of them, no credentials."""
    from sja.bus.auth import default_credentials_path
    from sja.bus.settings import BaseSettings

    auth = BaseSettings.from_env(env).nats.with_overrides(user=user, password=password)
    if not auth.configured:
        default = default_credentials_path()
        if default.is_file():
            auth = auth.with_overrides(credentials=str(default))
    return auth


async def _connect(nats: str, user: str, password: str, tenant: str) -> SjaClient:
    """A gateway client with the credentials of the options and the SJA_NATS_* environment (a
    credentials file, password file, creds file, TLS), scoped to ``tenant`` when one is given or the
    credentials file names one. Without ``--nats``/``SJA_NATS_URL`` the file's URL is used."""
    import os

    from sja.client import SjaClient

    auth = client_auth(os.environ, user, password)
    creds = auth.credentials_file()
    if creds is not None:
        tenant = tenant or creds.tenant
        if creds.url and nats == DEFAULT_NATS and "SJA_NATS_URL" not in os.environ:
            nats = creds.url
    return await SjaClient.connect(nats, tenant=tenant, auth=auth)


def with_client(
    nats: str, user: str, password: str, tenant: str, ask: Callable[[SjaClient], Awaitable[T]]
) -> T:
    """``ask``'s answer, from a client connected for it and closed once it has answered (whatever it
    raised). An unreachable server or gateway, refused credentials, bad settings and the gateway's
    refusal (``ApiError``) are each one line on stderr and exit 2."""
    from nats import errors as nats_errors

    from sja.bus.auth import NatsAuthError, NatsConfigError
    from sja.bus.connection import NatsUnreachableError
    from sja.bus.service import run_loop
    from sja.bus.settings import SettingsError
    from sja.client import ApiError

    async def connected() -> T:
        c = await _connect(nats, user, password, tenant)
        try:
            return await ask(c)
        finally:
            await c.close()

    try:
        return run_loop(connected())
    except BrokenPipeError as e:
        if output_closed():
            raise  # stdout's reader has gone (`| head`): not the gateway's fault; main() ends quietly
        fail(f"cannot reach the SJA gateway at {nats} ({type(e).__name__}): is the stack up? ({e})")
    except ApiError as e:
        fail(str(e))
    except NatsAuthError as e:
        fail(
            f"{e}: check --credentials (SJA_NATS_CREDENTIALS, ~/.config/sja/credentials.json), "
            "--user/--password (SJA_NATS_USER, SJA_NATS_PASSWORD) or SJA_NATS_CREDS"
        )
    except (NatsConfigError, SettingsError, ValueError) as e:
        fail(str(e))
    except (NatsUnreachableError, nats_errors.NoServersError) as e:
        fail(f"{e} — is the stack running? `sja up` (or give --nats / SJA_NATS_URL)")
    except nats_errors.NoRespondersError:
        fail(f"no SJA gateway answers at {nats} — is the stack running? `sja up`")
    except (OSError, nats_errors.TimeoutError, TimeoutError) as e:
        fail(f"cannot reach the SJA gateway at {nats} ({type(e).__name__}): is the stack up? ({e})")


def submit(
    files: Annotated[list[Path], typer.Argument(metavar="FILE...", help="Job spec files (YAML or JSON).")],
    nats: NatsOpt = DEFAULT_NATS,
    request_id: Annotated[str, typer.Option(metavar="KEY", help="Idempotency key (one file only).")] = "",
    as_json: JsonOpt = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
    tenant: TenantOpt = "",
    code: Annotated[
        Path | None,
        typer.Option(
            "--code",
            metavar="DIR",
            help="A command job's code: DIR is packed, uploaded through the gateway and unpacked "
            "read-only on each node, where the program runs in it (its working directory and "
            "PYTHONPATH). Same as `code: DIR` in the spec's params.",
        ),
    ] = None,
) -> None:
    """Submit jobs; prints each job id. Every problem of every file is reported (one line each,
    naming the file and the field) and nothing is submitted unless all files are good."""
    from sja.client import ApiError, SpecErrors, load_spec, read_spec_file

    specs = []
    problems: list[str] = []
    archives: dict[str, bytes] = {}
    for f in files:
        try:
            specs.append(load_spec(read_spec_file(f), str(f), base=f.parent, code=code, archives=archives))
        except SpecErrors as e:
            problems.extend(e.problems)
    if problems:
        fail_all(problems)
    if request_id and len(specs) > 1:
        fail("--request-id: one file only (each job needs its own key)")

    async def send(c: SjaClient) -> list[dict[str, Any]]:
        acks: list[dict[str, Any]] = []
        uploaded: set[tuple[str, str]] = set()
        try:
            for f, spec in zip(files, specs, strict=True):
                ref = spec.params.get("code", "")
                if ref in archives and (spec.tenant, ref) not in uploaded:
                    await c.upload_code(spec.tenant, archives[ref])
                    uploaded.add((spec.tenant, ref))
                ack = await c.submit(spec, request_id=request_id)
                acks.append({"file": str(f), "job_id": ack.job_id, "duplicate": ack.duplicate,
                             "notes": list(ack.notes)})  # fmt: skip
                if as_json:
                    continue
                console.print(ack.job_id + (" (already submitted)" if ack.duplicate else ""), highlight=False)
                for note in ack.notes:
                    err_console.print(
                        f"[yellow]note:[/] {ack.job_id}: {note}", soft_wrap=True, highlight=False
                    )
        except ApiError as e:
            if as_json and acks:
                print_json(acks)  # what was submitted before the refusal
            fail(str(e))
        return acks

    acks = with_client(nats, user, password, tenant, send)
    if as_json:
        print_json(acks)


def status(
    job_id: JobArg,
    nats: NatsOpt = DEFAULT_NATS,
    as_json: JsonOpt = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
    tenant: TenantOpt = "",
) -> None:
    """Show one job: state, progress, what runs now (slice, units, time left), the subjobs that ran
    in the order of their units, the result and whether a deadline was met."""
    from sja.cli.render import render_status, status_json

    s = with_client(nats, user, password, tenant, lambda c: c.status(job_id))
    now = time.time()
    if as_json:
        print_json(status_json(s, now))
        return
    for part in render_status(s, now):
        console.print(part, highlight=False)


def list_jobs(
    nats: NatsOpt = DEFAULT_NATS,
    tenant: Annotated[
        str,
        typer.Option(
            "--tenant",
            envvar="SJA_TENANT",
            metavar="TENANT",
            help="Only this tenant's jobs (through its own API subjects).",
        ),
    ] = "",
    as_json: JsonOpt = False,
    wide: Annotated[bool, typer.Option("--wide", help="More columns: submitted, agent, deadline.")] = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
) -> None:
    """List jobs (full ids: the other columns give way on a narrow terminal)."""
    from sja.cli.render import render_jobs

    states = with_client(nats, user, password, tenant, lambda c: c.jobs())
    if as_json:
        rows = [msgspec.to_builtins(s) for s in states]
        for r in rows:
            for k in ("accumulator", "profile", "history"):
                r.pop(k, None)
        print_json(rows)
        return
    console.print(render_jobs(states, time.time(), wide=wide, width=console.width), highlight=False)


def cancel(
    job_id: JobArg,
    nats: NatsOpt = DEFAULT_NATS,
    as_json: JsonOpt = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
    tenant: TenantOpt = "",
) -> None:
    """Cancel a job (a running subjob finishes; nothing new starts). A job that has already ended
    is left as it is: the command says so and exits 1."""
    from sja.core.jobs import is_terminal
    from sja.protocol.messages import JobState

    async def cancel_unless_ended(c: SjaClient) -> JobState:
        before = await c.status(job_id)
        if is_terminal(before):
            fail(f"job {job_id} has already ended ({before.status}): nothing to cancel", code=1)
        return await c.cancel(job_id)

    s = with_client(nats, user, password, tenant, cancel_unless_ended)
    if s.status in ("done", "failed"):
        fail(f"job {job_id} ended ({s.status}) before it could be cancelled", code=1)
    outcome = "cancelled" if s.status == "cancelled" else "cancelling"
    if as_json:
        from sja.cli.render import status_json

        print_json({"outcome": outcome, **status_json(s, time.time())})
        return
    console.print(f"{s.job_id}: {outcome}", highlight=False)


def _no_such_job(job_id: str) -> str:
    return f"no job {job_id} (`sja jobs` lists the jobs)"


def trace(
    job_id: JobArg,
    nats: NatsOpt = DEFAULT_NATS,
    limit: Annotated[int, typer.Option(metavar="N", help="Show the last N rounds.")] = 50,
    as_json: JsonOpt = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
    tenant: TenantOpt = "",
) -> None:
    """The rounds a job took part in: who replied, who won, and why."""
    from sja.cli.render import render_no_rounds, render_rounds
    from sja.client import ApiError
    from sja.protocol.messages import JobState, RoundRecord

    async def rounds_of(c: SjaClient) -> tuple[list[RoundRecord], JobState | None]:
        try:
            rounds = await c.rounds(job_id)
            # No round: a job not offered anything yet, or no such job at all.
            return rounds, None if rounds else await c.status(job_id)
        except ApiError as e:
            if e.error.code == "not_found":
                fail(_no_such_job(job_id))
            raise

    rounds, state = with_client(nats, user, password, tenant, rounds_of)
    if as_json:
        print_json(rounds[-limit:])
        return
    if state is not None:
        console.print(render_no_rounds(state), highlight=False)
        return
    console.print(render_rounds(job_id, rounds[-limit:]))


def explain(
    job_id: JobArg,
    nats: NatsOpt = DEFAULT_NATS,
    as_json: JsonOpt = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
    tenant: TenantOpt = "",
) -> None:
    """Why a job waits: for the last offer of each window shape, whether it bid and what became of
    its bid (or why it sent none), its place among the waiting jobs, and its deadline."""
    from sja.cli.render import render_explanation
    from sja.client import ApiError
    from sja.protocol.messages import Explanation

    async def explanation(c: SjaClient) -> Explanation:
        try:
            return await c.explain(job_id)
        except ApiError as err:
            if err.error.code == "not_found":
                fail(_no_such_job(job_id))
            raise

    e = with_client(nats, user, password, tenant, explanation)
    if as_json:
        print_json(e)
        return
    for part in render_explanation(e):
        console.print(part, highlight=False, soft_wrap=False)


def logs(
    job_id: JobArg,
    subjob: Annotated[
        str, typer.Option("--subjob", metavar="N", help="only this subjob: its number in the job, or its id")
    ] = "",
    nats: NatsOpt = DEFAULT_NATS,
    as_json: JsonOpt = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
    tenant: TenantOpt = "",
) -> None:
    """What each subjob's program wrote last: the end of its stdout and stderr (16 KiB at most), its
    status and, when it did not end ok, why."""
    from sja.client import ApiError
    from sja.protocol.messages import LogsView
    from sja.protocol.wording import unit_range

    async def logs_of(c: SjaClient) -> LogsView:
        try:
            return await c.logs(job_id, subjob)
        except ApiError as err:
            if err.error.code == "not_found":
                fail(err.error.message if subjob else _no_such_job(job_id))
            raise

    got = with_client(nats, user, password, tenant, logs_of)
    if as_json:
        print_json(got)
        return
    for note in got.notes:
        print(f"memory: {note}")
    if not got.subjobs:
        print(f"job {job_id}: no subjob has ended yet")
    for s in got.subjobs:
        print(
            f"== {s.subjob_id} on {s.slice_id}: {s.status}, units {unit_range(s.unit_start, s.units)}, "
            f"{s.units_done} done"
        )
        if s.error:
            print(f"-- reason:\n{s.error.rstrip()}")
        for name, text in (("stdout", s.stdout), ("stderr", s.stderr)):
            if text:
                print(f"-- {name}:\n{text.rstrip()}")


def result(
    job_id: str,
    out: Annotated[Path, typer.Option("--out", help="Directory to write the job's final state into.")],
    nats: NatsOpt = DEFAULT_NATS,
    no_merge: Annotated[
        bool, typer.Option("--no-merge", help="Fetch the parts; do not run merge_argv.")
    ] = False,
    as_json: JsonOpt = False,
    user: UserOpt = "",
    password: PasswordOpt = "",
    tenant: TenantOpt = "",
) -> None:
    """Fetch a finished job's final state: a command job's (its parts merged by merge_argv, when it has
    them), or a workload of your own package combined here by its merge and finalize. A command job
    that failed or was cancelled gives its last good state (what its completed subjobs left), with a
    note that it did not finish."""
    from sja.client import ApiError
    from sja.results import ResultError, fetch_result

    async def fetch(c: SjaClient) -> dict[str, Any]:
        try:
            state = await c.status(job_id)
            return await fetch_result(c, state, out, run_merge=not no_merge)
        except (ApiError, ResultError) as e:
            fail(str(e))

    got = with_client(nats, user, password, tenant, fetch)
    if as_json:
        print_json(got)
        return
    render_result(got)


def render_result(got: Mapping[str, Any]) -> None:
    """``sja result`` in words: where the state went, and a note when the job did not finish."""
    import json

    from rich.markup import escape

    what = [f"{got['parts']} part(s)"] if "parts" in got else []
    if got.get("merged"):
        what.append("merged by merge_argv")
    if "result" in got:
        what.append("result.json")
    detail = f" ({', '.join(what)})" if what else ""
    console.print(f"{got['job_id']}: state written to {got['out']}{detail}", soft_wrap=True, highlight=False)
    if "result" in got:
        console.print(json.dumps(got["result"], indent=2, sort_keys=True, default=str), highlight=False)
    if got.get("note"):
        err_console.print(f"[yellow]note:[/] {escape(str(got['note']))}", soft_wrap=True, highlight=False)
