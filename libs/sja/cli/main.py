"""``sja``: run the stack or one service, submit and inspect jobs, trace rounds, run the demo."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from sja.cli import choices, jobs
from sja.cli.output import JsonOpt, console, err_console, fail, output_closed, print_json
from sja.core import defaults

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)

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


# The job commands (sja.cli.jobs) are registered here, where `sja --help` lists them.
app.command()(jobs.submit)
app.command()(jobs.status)
app.command("jobs")(jobs.list_jobs)
app.command()(jobs.cancel)
app.command("trace")(jobs.trace)
app.command()(jobs.explain)
app.command()(jobs.logs)


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


app.command()(jobs.result)


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
