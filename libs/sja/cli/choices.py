"""Choices of the command line that follow the code it runs, not a list kept here: the clearing
policies are those registered (``sja.core.policies.REGISTRY``), read when the command line is read.
A policy added as one module and one registration is offered by ``sja up``, ``sja demo`` and
``sja simulate`` with no edit to the command line.

The commands name ``choices.PolicyName`` in their annotations, which Typer evaluates each time it
builds the command line (``main`` has ``from __future__ import annotations``): this module's
``__getattr__`` answers with a ``Literal`` of the names registered then. A type checker sees ``str``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sja.core.policies import REGISTRY

if TYPE_CHECKING:
    PolicyName = str
else:
    from typing import Literal

    def __getattr__(name: str) -> object:
        if name == "PolicyName":
            return Literal[tuple(policy_names())]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


SIMULATED_BASELINES = ("fifo", "easy", "bestfit")
"""The rigid schedulers ``sja simulate`` runs beside SJA (``sja.sim.baselines.BASELINES``, which
checks the names; too costly to import for a help line, and a test keeps the two the same)."""


def policy_names() -> list[str]:
    """The registered clearing policies, in registration order."""
    return list(REGISTRY)


def simulated_policies_help() -> str:
    """What ``sja simulate --policy`` takes: the baselines, SJA, and SJA under each policy."""
    names = [*SIMULATED_BASELINES, "sja", *(f"sja:{p}" for p in policy_names())]
    return f"Comma-separated, from: {', '.join(names)}."
