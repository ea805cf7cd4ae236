"""``sja``: run the stack or one service, submit and inspect jobs, trace rounds, run the demo."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from sja.cli import choices
from sja.core import defaults

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()
err_console = Console(stderr=True)

_TYPE_METAVARS = {"str": "TEXT", "int": "INTEGER", "float": "NUMBER", "path": "PATH", "bool": "BOOLEAN"}


def _conventional_help() -> None:
    """Show option values in help as the conventions have them: flags bare, values by an upper-case
    metavar (``TEXT``, ``INTEGER``, ``PATH``, ``FILE...``) and choices as ``[a|b]``. Typer labels
    them with Python types (``<str>``, ``<list[Path]>``, ``--json <bool>``)."""
    from typer import core

    def conventional(original: Any) -> Any:
        def display_type_rich(self: Any, ctx: Any) -> str | None:
            if getattr(self, "is_flag", False) or getattr(self, "count", False):
                return None
            if self.metavar is not None:
                return str(self.metavar)
            text: str | None = original(self, ctx)
            if text is None:
                return None
            suffix = ""
            if text.endswith("..."):
                text, suffix = text[:-3], "..."
            inner = text[1:-1] if text.startswith("<") and text.endswith(">") else text
            if inner.startswith("list[") and inner.endswith("]"):
                inner, suffix = inner[5:-1], "..."
            if "|" in inner:
                return f"[{inner}]{suffix}"
            return _TYPE_METAVARS.get(inner.lower(), inner.upper()) + suffix

        return display_type_rich

    for cls in (core.TyperOption, core.TyperArgument):
        if hasattr(cls, "display_type_rich") and not getattr(cls, "_sja_conventional", False):
            cls.display_type_rich = conventional(cls.display_type_rich)  # type: ignore[method-assign]
            setattr(cls, "_sja_conventional", True)  # noqa: B010 (marks typer's class as patched)


_conventional_help()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("sja")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        console.print(f"sja {v}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
    credentials: Annotated[
        str,
        typer.Option(
            "--credentials",
            envvar="SJA_NATS_CREDENTIALS",
            metavar="FILE",
            help="NATS credentials file (0600) of the operator or a tenant; default: the one `sja up` "
            "wrote (~/.config/sja/credentials.json).",
        ),
    ] = "",
) -> None:
    """SJA: run the stack or one service, submit and inspect jobs, trace rounds, run the demo."""
    import os

    if credentials:
        os.environ["SJA_NATS_CREDENTIALS"] = credentials  # read with the other SJA_NATS_* settings


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the result as JSON (every field, full ids) instead of text.")
]


def print_json(data: Any) -> None:
    """A command's result under ``--json``: one JSON document on stdout, every field, full ids (the
    one way every command prints JSON; errors stay one line on stderr)."""
    print(json.dumps(msgspec.to_builtins(data), indent=2))


def output_closed(fd: int = 1) -> bool:
    """Whether nobody reads ``fd`` any more (stdout piped into ``head`` that has exited): the pipe's
    write end reports an error or a hang-up."""
    import select

    try:
        poller = select.poll()
        poller.register(fd, 0)  # errors and hang-ups only: always reported
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


CLOSED_OUTPUT_EXIT = 141
"""The exit status of a command whose reader went away (128 + SIGPIPE, as ``cat`` or ``ls`` in a
pipeline): ``sja jobs --json | head`` ends quietly."""


def _quiet_exit_on_closed_output() -> None:
    """The reader of stdout has gone: nothing more is written (what is still buffered goes to
    ``/dev/null``, so that the interpreter's own last flush does not complain), no error is said."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(CLOSED_OUTPUT_EXIT)


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


async def _connect_client(nats: str, user: str, password: str, tenant: str) -> Any:
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


def fail(message: str, code: int = 2) -> None:
    """One line on stderr (never wrapped, brackets shown as written), then exit with ``code``."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def run_async(coro: Any) -> Any:
    from sja.bus.service import run_loop

    return run_loop(coro)


@app.command()
def service(
    name: Annotated[
        str,
        typer.Argument(
            metavar="SERVICE[,SERVICE...]",
            help="inventory|advertiser|clearer|agent|executor|gateway|ui, or several separated by commas "
            "to run them in one process (e.g. inventory,gateway,clearer,advertiser).",
        ),
    ],
) -> None:
    """Run a service (or several, co-hosted in one process) in the foreground (settings from SJA_*
    environment variables; co-hosted, each is named <service>-<SJA_INSTANCE>)."""
    import os
    import socket

    from services.registry import cohosted_instance, load, parse_names
    from sja.bus.service import freeze_after_start, run_loop, run_services, tune_gc
    from sja.bus.settings import SettingsError
    from sja.telemetry.logs import configure_logging

    try:
        names = parse_names(name)
    except ValueError as e:
        fail(str(e))
        return
    services = []
    for n in names:
        svc_cls, settings_cls = load(n)
        try:
            settings = settings_cls.from_env(os.environ)
        except SettingsError as e:
            fail(str(e))
            return
        settings = msgspec.structs.replace(settings, nats=settings.nats.for_service(n))
        if len(names) > 1:
            base = settings.instance or f"{socket.gethostname()}-{os.getpid()}"
            settings = msgspec.structs.replace(settings, instance=cohosted_instance(n, base))
        services.append(svc_cls(settings))
    first = services[0].settings
    configure_logging(first.log_level)
    tune_gc()
    try:
        run_loop(run_services(services, ready=freeze_after_start), first.event_loop)
    except ValueError as e:
        fail(str(e))


@app.command()
def up(
    out: Annotated[Path, typer.Option(metavar="DIR", help="Directory for logs and traces.")] = Path(
        "out/stack"
    ),
    inventory: Annotated[
        str, typer.Option(metavar="FILE", help="Declared inventory file (default: built-in).")
    ] = "",
    policy: Annotated[choices.PolicyName, typer.Option(help="Clearing policy.")] = defaults.POLICY,
    agents: Annotated[int, typer.Option(metavar="N", help="Agent processes.")] = 1,
    port: Annotated[int, typer.Option(metavar="PORT", help="NATS port (0: 4222 if free, else any).")] = 0,
    ui_port: Annotated[
        int,
        typer.Option(
            envvar="SJA_UI_PORT",
            metavar="PORT",
            help="Dashboard port on 127.0.0.1 (0: 8080 if free, else any).",
        ),
    ] = 0,
    keep_store: Annotated[
        Path | None,
        typer.Option(
            "--keep-store",
            help="Keep the NATS store (jobs, leases, rounds) in DIR across runs; default: a temporary "
            "store removed at exit, so every `sja up` starts empty.",
            metavar="DIR",
        ),
    ] = None,
    cohost: Annotated[
        str,
        typer.Option(
            help="Services to run together in one process, comma-separated (e.g. "
            "inventory,gateway,clearer,advertiser: fewer processes on a small machine); default: a "
            "process per service.",
            metavar="SERVICES",
        ),
    ] = "",
    tenants: Annotated[
        str,
        typer.Option(
            help="Tenants to make NATS users for, comma-separated (each gets its own credentials file).",
            metavar="NAMES",
        ),
    ] = "",
    credentials: Annotated[
        Path | None,
        typer.Option(
            "--credentials",
            help="Where to write the operator's credentials, which `sja` finds there by default "
            "(default: ~/.config/sja/credentials.json).",
            metavar="FILE",
        ),
    ] = None,
) -> None:
    """Start the whole stack on this machine: embedded nats-server (with a user and a fresh password
    per service, for the operator and per tenant: no anonymous connection), local Ray, every service."""
    import signal
    import socket

    from services.registry import parse_cohost
    from sja import dashauth
    from sja.bus.natsd import EmbeddedNats, free_port
    from sja.stack import UP_ORDER, LocalStack

    groups: list[list[str]] = []
    if cohost:
        try:
            groups = [parse_cohost(cohost)]
        except ValueError as e:
            fail(f"--cohost: {e}")
        if "agent" in groups[0] and agents != 1:
            fail(f"--cohost: a co-hosted agent runs one replica, not --agents {agents}")
    if not port:
        with socket.socket() as s:
            port = 4222 if s.connect_ex(("127.0.0.1", 4222)) != 0 else free_port()
    if not ui_port:
        with socket.socket() as s:
            ui_port = 8080 if s.connect_ex(("127.0.0.1", 8080)) != 0 else free_port()
    from sja.bus import roles
    from sja.bus.auth import default_credentials_path, read_credentials, write_credentials
    from sja.stack import DEFAULT_TENANTS

    names = [t.strip() for t in tenants.split(",") if t.strip()] if tenants else list(DEFAULT_TENANTS)
    for t in names:
        try:
            roles.tenant_role(t)
        except ValueError as e:
            fail(f"--tenants: {e}")
    # The dashboard's secret: new at every start (the tokens of an earlier run stop working), in a
    # file only this user reads; the service reads it from there, never from its command line.
    secret_file = (out / DASHBOARD_SECRET).absolute()
    dashboard_secret = dashauth.write_secret(secret_file)
    stack = LocalStack(
        out_dir=out,
        env={"SJA_INVENTORY": inventory, "SJA_POLICY": policy},
        service_env={
            "ui": {
                "SJA_UI_PORT": str(ui_port),
                "SJA_UI_HOST": "127.0.0.1",
                "SJA_UI_TOKEN_FILE": str(secret_file),
            }
        },
        replicas={"agent": agents},
        groups=groups,
        auth=True,
        tenants=names,
    )
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if keep_store is not None:
        keep_store.mkdir(parents=True, exist_ok=True)
    # No store_dir: EmbeddedNats makes a temporary one and removes it when stopped.
    nats_conf = stack.prepare_auth(f"nats://127.0.0.1:{port}")
    operator_file = credentials or default_credentials_path()
    write_credentials(operator_file, read_credentials(stack.credentials()))
    stack.nats = EmbeddedNats(
        port=port,
        store_dir=str(keep_store) if keep_store is not None else "",
        config_file=str(nats_conf),
        log_file=str(out / "logs" / "nats.log"),
    )

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # stop like Ctrl-C: services first, then NATS and its store

    signal.signal(signal.SIGTERM, on_sigterm)
    stack.nats.start()
    stack.nats_url = stack.nats.url
    try:
        stack.start(order=UP_ORDER)
        run_async(stack.wait_ready())
        store = f"store in {keep_store}" if keep_store is not None else "temporary store"
        lines = up_banner(
            sja_command(sys.argv[0], sys.executable),
            nats_url=stack.nats_url,
            store=store,
            logs=f"{out}/logs",
            operator_file=str(operator_file),
            tenant_files=f"{stack.credentials_dir}/tenant-<name>.json",
            dashboard=f"http://127.0.0.1:{ui_port}/?token={dashauth.operator_token(dashboard_secret)}",
            secret_file=str(secret_file),
        )
        for line in lines:
            # Never wrapped: a command cut in two cannot be pasted back into a shell.
            console.print(line, soft_wrap=True, highlight=False, markup=False)
        while all(p.proc.poll() is None for p in stack.procs):
            time.sleep(0.5)
        dead = [p.instance for p in stack.procs if p.proc.poll() is not None]
        err_console.print(f"[red]service(s) exited:[/] {', '.join(dead)}")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        console.print("stopping…")
        stack.stop()


def sja_command(argv0: str, executable: str, path: str | None = None, cwd: Path | None = None) -> str:
    """How the user can run this very ``sja`` from their shell: ``sja`` when the ``sja`` found on
    ``PATH`` is this one; else its path (relative to ``cwd`` when below it, e.g. ``.venv/bin/sja``
    when the virtual environment is not activated); ``python -m sja.cli.main`` with this
    interpreter's path when no ``sja`` script is at hand (``argv0`` the running script,
    ``executable`` the interpreter)."""
    import os
    import shlex
    import shutil

    here = Path(cwd if cwd is not None else Path.cwd())
    script = Path(argv0)
    if script.name != "sja" or not script.exists():
        script = Path(executable).parent / "sja"  # the venv's own script, beside its python
    if not script.exists():
        return f"{shlex.quote(executable)} -m sja.cli.main"
    script = script if script.is_absolute() else here / script
    found = shutil.which("sja", path=path if path is not None else os.environ.get("PATH", ""))
    if found is not None and os.path.realpath(found) == os.path.realpath(script):
        return "sja"
    try:
        shown = str(script.relative_to(here))
    except ValueError:
        shown = str(script)
    return shlex.quote(shown if "/" in shown else f"./{shown}")


def up_banner(
    sja: str,
    *,
    nats_url: str,
    store: str,
    logs: str,
    operator_file: str,
    tenant_files: str,
    dashboard: str,
    secret_file: str,
) -> list[str]:
    """What ``sja up`` prints once the stack is up: each line whole (the caller never wraps them),
    every command as ``sja`` (``sja_command``) can be run by the user."""
    return [
        f"SJA is up — NATS at {nats_url} ({store}), logs in {logs}",
        f"  operator credentials: {operator_file} (0600; `{sja}` reads them there); "
        f"per tenant: {tenant_files}",
        f"  export SJA_NATS_URL={nats_url}; {sja} submit examples/jobs/matmul.yaml",
        f"  {sja} jobs; {sja} status JOB; {sja} logs JOB; {sja} result JOB --out DIR",
        f"  dashboard: {dashboard}",
        f"  a tenant's view: {sja} dashboard-token --tenant NAME --secret-file {secret_file}",
        "  Ctrl-C stops the stack.",
    ]


@app.command()
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

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        acks = []
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
        finally:
            await c.close()
        if as_json:
            print_json(acks)

    _with_connection_errors(go, nats)


def fail_all(lines: list[str], code: int = 2) -> None:
    """Each problem on a line of its own on stderr, then exit with ``code``."""
    from rich.markup import escape

    for line in lines:
        err_console.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def _with_connection_errors(fn: Any, url: str) -> None:
    """Run a client command; an unreachable server or gateway is one line on stderr and exit 2."""
    import nats.errors

    from sja.bus.auth import NatsAuthError, NatsConfigError
    from sja.bus.connection import NatsUnreachableError
    from sja.bus.settings import SettingsError
    from sja.client import ApiError

    try:
        run_async(fn())
    except BrokenPipeError as e:
        if output_closed():
            raise  # stdout's reader has gone (`| head`): not the gateway's fault; main() ends quietly
        fail(f"cannot reach the SJA gateway at {url} ({type(e).__name__}): is the stack up? ({e})")
    except ApiError as e:
        fail(str(e))
    except NatsAuthError as e:
        fail(
            f"{e}: check --credentials (SJA_NATS_CREDENTIALS, ~/.config/sja/credentials.json), "
            "--user/--password (SJA_NATS_USER, SJA_NATS_PASSWORD) or SJA_NATS_CREDS"
        )
    except (NatsConfigError, SettingsError, ValueError) as e:
        fail(str(e))
    except (NatsUnreachableError, nats.errors.NoServersError) as e:
        fail(f"{e} — is the stack running? `sja up` (or give --nats / SJA_NATS_URL)")
    except nats.errors.NoRespondersError:
        fail(f"no SJA gateway answers at {url} — is the stack running? `sja up`")
    except (OSError, nats.errors.TimeoutError, TimeoutError) as e:
        fail(f"cannot reach the SJA gateway at {url} ({type(e).__name__}): is the stack up? ({e})")


@app.command()
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
    from sja.client import ApiError

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        try:
            s = await c.status(job_id)
        except ApiError as e:
            fail(str(e))
            return
        finally:
            await c.close()
        now = time.time()
        if as_json:
            print_json(status_json(s, now))
            return
        for part in render_status(s, now):
            console.print(part, highlight=False)

    _with_connection_errors(go, nats)


@app.command("jobs")
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

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        try:
            states = await c.jobs()
        finally:
            await c.close()
        if as_json:
            rows = [msgspec.to_builtins(s) for s in states]
            for r in rows:
                for k in ("accumulator", "profile", "history"):
                    r.pop(k, None)
            print_json(rows)
            return
        console.print(render_jobs(states, time.time(), wide=wide, width=console.width), highlight=False)

    _with_connection_errors(go, nats)


@app.command()
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
    from sja.client import ApiError
    from sja.core.jobs import is_terminal

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        try:
            before = await c.status(job_id)
            if is_terminal(before):
                fail(f"job {job_id} has already ended ({before.status}): nothing to cancel", code=1)
            s = await c.cancel(job_id)
        except ApiError as e:
            fail(str(e))
            return
        finally:
            await c.close()
        if s.status in ("done", "failed"):
            fail(f"job {job_id} ended ({s.status}) before it could be cancelled", code=1)
        outcome = "cancelled" if s.status == "cancelled" else "cancelling"
        if as_json:
            from sja.cli.render import status_json

            print_json({"outcome": outcome, **status_json(s, time.time())})
            return
        console.print(f"{s.job_id}: {outcome}", highlight=False)

    _with_connection_errors(go, nats)


@app.command("trace")
def trace_cmd(
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

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        try:
            rounds = await c.rounds(job_id)
            # No round: a job not offered anything yet, or no such job at all.
            state = None if rounds else await c.status(job_id)
        except ApiError as e:
            if e.error.code == "not_found":
                fail(f"no job {job_id} (`sja jobs` lists the jobs)")
            raise
        finally:
            await c.close()
        if as_json:
            print_json(rounds[-limit:])
            return
        if state is not None:
            console.print(render_no_rounds(state), highlight=False)
            return
        console.print(render_rounds(job_id, rounds[-limit:]))

    _with_connection_errors(go, nats)


@app.command()
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

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        try:
            e = await c.explain(job_id)
        except ApiError as err:
            if err.error.code == "not_found":
                fail(f"no job {job_id} (`sja jobs` lists the jobs)")
            raise
        finally:
            await c.close()
        if as_json:
            print_json(e)
            return
        for part in render_explanation(e):
            console.print(part, highlight=False, soft_wrap=False)

    _with_connection_errors(go, nats)


@app.command()
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
    from sja.protocol.wording import unit_range

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        try:
            got = await c.logs(job_id, subjob)
        except ApiError as err:
            if err.error.code == "not_found":
                fail(err.error.message if subjob else f"no job {job_id} (`sja jobs` lists the jobs)")
            raise
        finally:
            await c.close()
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

    _with_connection_errors(go, nats)


@app.command()
def inventory(
    source: Annotated[
        str,
        typer.Option(
            "--source",
            envvar="SJA_INVENTORY_SOURCE",
            metavar="SOURCE",
            help="declared[:FILE] | nvml | fake-nvml:SCENARIO (h100-mig, h100-nomig, a100-40gb, node, ...).",
        ),
    ] = "declared",
    node: Annotated[
        str,
        typer.Option(
            "--node", envvar="SJA_NODE", metavar="NODE", help="Node name of NVML-discovered slices."
        ),
    ] = "local",
    soft_slices: Annotated[
        str,
        typer.Option(
            "--soft-slices",
            envvar="SJA_SOFT_SLICES",
            metavar="N|MIB,MIB...",
            help="GPUs without MIG: N equal soft slices, or MiB sizes '20000,40000'; empty: whole.",
        ),
    ] = "",
    as_json: JsonOpt = False,
    ray_resources: Annotated[
        bool,
        typer.Option(
            "--ray-resources",
            help="Print the custom resources to give `ray start --resources` on this node (JSON).",
        ),
    ] = False,
) -> None:
    """Show the slices an inventory source sees (what the inventory service would publish)."""
    from sja.execution.actor import node_resources
    from sja.inventory.declared import InventoryError
    from sja.inventory.sources import read_source

    try:
        found = read_source(source, node=node, soft_slices=soft_slices)
    except InventoryError as e:
        fail(str(e))
    if ray_resources:
        print(json.dumps(node_resources(node, [s.slice_id for s in found.slices if s.node == node])))
        return
    if as_json:
        payload = {
            "source": source,
            "slices": [msgspec.to_builtins(s) for s in found.slices],
            "lost": found.lost,
            "warnings": found.warnings,
        }
        print_json(payload)
        return
    table = Table()
    for column in ("slice", "node", "gpu", "model", "profile", "MiB", "share", "source", "device"):
        table.add_column(column, overflow="fold")
    for s in found.slices:
        table.add_row(
            s.slice_id,
            s.node,
            str(s.gpu_index),
            s.gpu_model,
            s.profile,
            str(s.mem_mib),
            f"{s.compute_share:.2f}",
            s.source,
            s.gpu_uuid,
        )
    console.print(table)
    for w in found.warnings:
        err_console.print(f"[yellow]warning:[/] {w}")
    for gpu in found.lost:
        err_console.print(f"[red]lost GPU[/] {gpu}")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(metavar="DIR", help="Where the summary, timeline and logs go.")] = Path(
        "out/demo"
    ),
    policy: Annotated[choices.PolicyName, typer.Option(help="Clearing policy.")] = defaults.POLICY,
    quick: Annotated[bool, typer.Option(help="Smaller jobs (for tests).")] = False,
) -> None:
    """Start the stack, run mixed jobs from two tenants, show progress, write a summary and a timeline."""
    from sja.cli.demo import run_demo

    code = run_demo(out, policy=policy, quick=quick)
    raise typer.Exit(code)


def _simulated_policies(value: str) -> str:
    from sja.sim.runner import parse_policies

    try:
        parse_policies(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


@app.command()
def simulate(
    trace: Annotated[
        Path,
        typer.Option("--trace", metavar="FILE", help="Trace file (openb pod list, ms-itp CSV, generic CSV)."),
    ],
    fmt: Annotated[Literal["alibaba-openb", "ms-itp", "csv"], typer.Option("--format", help="Trace format.")],
    cluster: Annotated[
        str,
        typer.Option(
            "--cluster", metavar="SPEC", help="Cluster spec, e.g. 8xA100-40GB or 4xH100-80GB:4g.40gb+3g.40gb."
        ),
    ] = "8xA100-80GB",
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            metavar="POLICY[,POLICY...]",
            callback=_simulated_policies,
            help=choices.simulated_policies_help(),
        ),
    ] = "fifo,easy,bestfit,sja",
    json_out: Annotated[
        Path | None, typer.Option("--json", metavar="FILE", help="Write the metrics per policy here.")
    ] = None,
    report: Annotated[
        Path | None, typer.Option("--report", metavar="DIR", help="Write report.md and plots here.")
    ] = None,
    limit: Annotated[int | None, typer.Option(metavar="N", help="Only the first N jobs.")] = None,
    time_scale: Annotated[
        float, typer.Option(metavar="FACTOR", help="Multiply submission times (<1 compresses).")
    ] = 1.0,
    start_s: Annotated[
        float | None,
        typer.Option(metavar="SECONDS", help="Trace time that becomes 0 (earlier jobs dropped)."),
    ] = None,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of every modeled quantity.")] = 0,
    overhead_s: Annotated[
        float | None,
        typer.Option(metavar="SECONDS", help="Per-subjob start+checkpoint seconds (default 10+5)."),
    ] = None,
    eps_mem: Annotated[
        float | None,
        typer.Option(
            metavar="P", help=f"Jobs' memory violation target (default {defaults.EPS_MEM:g}, the stack's)."
        ),
    ] = None,
    horizon_s: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help=f"Length of an offered window, virtual s (default {defaults.HORIZON_S:g}, the stack's).",
        ),
    ] = None,
    unit_s: Annotated[
        float | None,
        typer.Option(metavar="SECONDS", help="Seconds of a job's runtime per work unit (default 60)."),
    ] = None,
    speed_table: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="MISO mig_iter_time_summary.csv: measured slice speeds."),
    ] = None,
    packing_demand: Annotated[
        float | None,
        typer.Option(
            metavar="DEMAND", help="Run openb packing at this demand (e.g. 1.3) instead of a replay."
        ),
    ] = None,
    nodes: Annotated[
        Path | None, typer.Option(metavar="FILE", help="openb node list for --packing-demand.")
    ] = None,
    packing_seeds: Annotated[int, typer.Option(metavar="N", help="Seeds averaged by --packing-demand.")] = 10,
) -> None:
    """Replay a trace in virtual time under SJA and rigid baselines; write metrics and a report."""
    from sja.cli.simulate import simulate_command

    code = simulate_command(
        trace=trace,
        fmt=fmt,
        cluster=cluster,
        policies=policy,
        json_out=json_out,
        report_dir=report,
        limit=limit,
        time_scale=time_scale,
        start_s=start_s,
        seed=seed,
        overhead_s=overhead_s,
        eps_mem=eps_mem,
        horizon_s=horizon_s,
        unit_s=unit_s,
        speed_table=speed_table,
        packing_demand=packing_demand,
        nodes=nodes,
        packing_seeds=packing_seeds,
        console=console,
        err_console=err_console,
    )
    raise typer.Exit(code)


DASHBOARD_SECRET = "dashboard.secret"
"""The dashboard's secret, in ``sja up``'s ``--out`` directory."""


@app.command("dashboard-token")
def dashboard_token(
    tenant: Annotated[
        str,
        typer.Option(
            "--tenant",
            metavar="TENANT",
            help="Mint this tenant's token (its own jobs only); default: the operator's.",
        ),
    ] = "",
    secret_file: Annotated[
        Path | None,
        typer.Option(
            "--secret-file",
            envvar="SJA_UI_TOKEN_FILE",
            metavar="FILE",
            help="The dashboard's secret (`sja up` writes it in its --out directory); default: "
            "$SJA_OUT_DIR/ui/dashboard.secret where SJA_OUT_DIR is set (the dashboard service's own), "
            "else out/stack/dashboard.secret (`sja up`'s).",
        ),
    ] = None,
    url: Annotated[
        str, typer.Option("--url", metavar="URL", help="Print the dashboard's address with the token.")
    ] = "",
    as_json: JsonOpt = False,
) -> None:
    """Print a dashboard token, derived from the dashboard's secret (nothing new is stored): the
    operator's, or with --tenant one that shows that tenant's jobs only."""
    import os

    from sja import dashauth

    if secret_file is None:
        out_dir = os.environ.get("SJA_OUT_DIR", "")
        secret_file = (
            Path(out_dir) / "ui" / DASHBOARD_SECRET if out_dir else Path("out/stack") / DASHBOARD_SECRET
        )
    try:
        secret = dashauth.read_secret(secret_file)
        token = dashauth.tenant_token(secret, tenant) if tenant else dashauth.operator_token(secret)
    except ValueError as e:
        fail(str(e))
        return
    address = f"{url.rstrip('/')}/?token={token}" if url else ""
    if as_json:
        print_json({"tenant": tenant, "token": token, "url": address})
        return
    print(address or token)


@app.command()
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

    async def go() -> None:
        c = await _connect_client(nats, user, password, tenant)
        try:
            state = await c.status(job_id)
            got = await fetch_result(c, state, out, run_merge=not no_merge)
        except (ApiError, ResultError) as e:
            fail(str(e))
            return
        finally:
            await c.close()
        if as_json:
            print_json(got)
            return
        render_result(got)

    _with_connection_errors(go, nats)


def render_result(got: Mapping[str, Any]) -> None:
    """``sja result`` in words: where the state went, and a note when the job did not finish."""
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


def main() -> None:
    """The ``sja`` command. A command line it cannot take (an unknown option, a value not among the
    choices) is one line on stderr naming the option, and exit code 2. A reader of its output that
    goes away (``sja jobs --json | head``) ends it quietly with exit status 141, as other tools."""
    from rich.markup import escape

    # Typer raises click's exceptions (its own copy of click in recent versions): found by name.
    by_name: dict[str, type[BaseException]] = {
        c.__name__: c for c in typer.BadParameter.__mro__ if issubclass(c, BaseException)
    }
    usage_error, click_exception = by_name["UsageError"], by_name["ClickException"]

    def one_line(e: Any) -> str:
        return escape(" ".join(e.format_message().split()).replace("Value error, ", ""))

    # Rich (ours, and Typer's help) ends a command whose reader has gone with exit status 1, as if it
    # had failed: every console ends it quietly instead.
    Console.on_broken_pipe = lambda self: _quiet_exit_on_closed_output()  # type: ignore[method-assign]
    try:
        code = app(standalone_mode=False)
        sys.stdout.flush()  # what is still buffered: its reader may have gone meanwhile
    except BrokenPipeError:
        _quiet_exit_on_closed_output()
    except SystemExit as e:
        # Typer ends a command whose stdout broke (EPIPE) with exit status 1; it is no failure.
        if e.code == 1 and output_closed():
            _quiet_exit_on_closed_output()
        raise
    except usage_error as e:
        ctx = getattr(e, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        err_console.print(f"[bold red]error:[/] {one_line(e)}{where}", soft_wrap=True, highlight=False)
        sys.exit(getattr(e, "exit_code", 2))
    except click_exception as e:
        err_console.print(f"[bold red]error:[/] {one_line(e)}", soft_wrap=True, highlight=False)
        sys.exit(getattr(e, "exit_code", 1))
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
