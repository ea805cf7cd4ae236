"""What every ``sja`` command writes: its result on stdout (text, or one JSON document under
``--json``) and its errors as one line each on stderr."""

from __future__ import annotations

import json
from typing import Annotated, Any, NoReturn

import msgspec
import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

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


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr (never wrapped, brackets shown as written), then exit with ``code``."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def fail_all(lines: list[str], code: int = 2) -> NoReturn:
    """Each problem on a line of its own on stderr, then exit with ``code``."""
    from rich.markup import escape

    for line in lines:
        err_console.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)
