"""Imports point downward: every module of ``libs/sja`` and ``services/`` imports only from its own
layer or the layers below it, as the code map of ``docs/contributing.md`` lays them out, and the
pure core (with the simulator, the same core in virtual time) reaches nothing that starts a process
or talks to NATS, not even through what it imports. Every import counts, those inside functions and
under ``TYPE_CHECKING`` too: the modules are read with ``ast``, never imported."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS: list[set[str]] = [  # bottom up
    {"sja", "sja.protocol", "sja.job", "sja.dashauth"},
    {"sja.workloads"},
    {"sja.core"},
    {"sja.sim", "sja.inventory", "sja.telemetry", "sja.redaction", "sja.results", "sja.accel"},
    {"sja.bus"},
    {"sja.execution", "sja.client", "sja.stack"},
    {"services"},
    {"sja.cli", "sja.audit"},
]
PURE = {"sja.core", "sja.sim"}
NOT_FOR_THE_PURE = {
    "sja.bus", "sja.execution", "sja.inventory", "sja.client", "sja.stack", "services",
    "subprocess", "multiprocessing", "ray", "nats",
}  # fmt: skip


def _modules() -> dict[str, Path]:
    """Every module of ``libs/sja`` and ``services/`` by its dotted name."""
    found = {}
    for base, top in ((ROOT / "libs", ROOT / "libs" / "sja"), (ROOT, ROOT / "services")):
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def unit(module: str) -> str:
    """What a module belongs to in ``LAYERS``: its package of ``sja`` (or module directly under
    it), or ``services``; anything else (the standard library, another project) by its top name."""
    parts = module.split(".")
    if parts[0] == "sja":
        return ".".join(parts[:2])
    return parts[0]


def imports(module: str) -> Iterator[tuple[int, str]]:
    """``(line, imported module)`` for each import of ``module``, wherever it stands."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if sub in MODULES else base


def layer(u: str) -> int:
    for i, members in enumerate(LAYERS):
        if u in members:
            return i
    raise AssertionError(f"{u} is in no layer: place it in LAYERS, as docs/contributing.md does")


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_every_module_imports_its_own_layer_or_below() -> None:
    upward = []
    for module in MODULES:
        mine = layer(unit(module))
        for line, target in imports(module):
            if target not in MODULES:
                continue  # the standard library or another project
            theirs = layer(unit(target))
            if theirs > mine:
                upward.append(
                    f"{where(module, line)}: {module} imports {target} ({unit(target)} lies above "
                    f"{unit(module)})"
                )
    assert not upward, "imports that point upward:\n" + "\n".join(upward)


def test_a_service_imports_no_other_service() -> None:
    across = [
        f"{where(module, line)}: {module} imports {target}"
        for module in MODULES
        if module.startswith("services.")
        for line, target in imports(module)
        if target.startswith("services.") and target.split(".")[1] != module.split(".")[1]
    ]
    assert not across, "services that import another service:\n" + "\n".join(across)


def _with_parents(module: str) -> list[str]:
    """``a.b.c`` and the packages an import of it runs first: ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def test_the_pure_core_reaches_no_process_nats_or_ray() -> None:
    came_from: dict[str, str] = {m: "" for m in MODULES if unit(m) in PURE}
    todo = deque(came_from)  # breadth first: each chain reported is a shortest one
    reached = []
    while todo:
        module = todo.popleft()
        for line, target in imports(module):
            if unit(target) in NOT_FOR_THE_PURE:
                path = [module]
                while came_from[path[-1]]:
                    path.append(came_from[path[-1]])
                chain = " -> ".join(reversed(path))
                reached.append(f"{where(module, line)}: {chain} imports {target}")
                continue
            for m in _with_parents(target):
                if m in MODULES and m not in came_from:
                    came_from[m] = module
                    todo.append(m)
    assert not reached, "the pure core reaches what it must not:\n" + "\n".join(sorted(reached))


def test_the_check_sees_what_it_must() -> None:
    """The checks above read what they should: imports inside functions and relative ones, and a
    module's layer by its package."""
    assert unit("sja.core.policies.fair") == "sja.core" and unit("services.agent.service") == "services"
    assert layer("sja.core") < layer("sja.bus") < layer("services") < layer("sja.cli")
    # ``from sja.cli.render import ...`` inside a command's function.
    assert "sja.cli.render" in {t for _, t in imports("sja.cli.jobs")}
    # ``from sja import job`` names the module, ``from sja import __version__`` the package.
    assert "sja.job" in {t for _, t in imports("sja.execution.runner")}
    assert "sja" in {t for _, t in imports("sja.bus.service")}
    assert {"sja.core", "sja.sim", "sja.protocol", "sja.workloads"} <= {unit(m) for m in MODULES}
