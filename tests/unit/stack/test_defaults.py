"""One set of defaults: the simulator evaluates what the services, ``sja up`` and compose run.

The window length, the planner's start overhead, the clearing policy and the jobs' default ``eps``
come from ``sja.core.defaults`` everywhere; ``docker-compose.yml`` states none of them (a value
there would make the compose stack something the evaluation did not evaluate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.advertiser.service import AdvertiserSettings
from services.agent.settings import AgentSettings
from services.clearer.settings import ClearerSettings
from services.gateway.service import GatewaySettings
from sja.core import defaults
from sja.core.planner import PlanLimits
from sja.protocol.messages import JobSpec
from sja.sim.model import SimConfig
from sja.sim.runner import parse_policies

ROOT = Path(__file__).resolve().parents[3]


def test_the_simulator_runs_the_stacks_defaults() -> None:
    cfg = SimConfig()
    assert cfg.horizon_s == defaults.HORIZON_S
    assert cfg.start_overhead_s == defaults.START_OVERHEAD_S
    assert cfg.policy == defaults.POLICY
    assert (cfg.eps_mem, cfg.eps_time) == (defaults.EPS_MEM, defaults.EPS_TIME)
    limits = cfg.limits()
    assert (limits.horizon_s, limits.start_overhead_s) == (defaults.HORIZON_S, defaults.START_OVERHEAD_S)
    # `sja simulate --policy sja` is the policy the stack clears by.
    assert parse_policies("sja") == [f"sja:{defaults.POLICY}"]


def test_the_services_and_the_planner_run_the_same_defaults() -> None:
    for settings in (AdvertiserSettings(), AgentSettings(), ClearerSettings(), GatewaySettings()):
        assert settings.horizon_s == defaults.HORIZON_S, type(settings).__name__
    for settings in (AgentSettings(), GatewaySettings()):
        assert settings.start_overhead_s == defaults.START_OVERHEAD_S, type(settings).__name__
    assert ClearerSettings().policy == defaults.POLICY
    limits = PlanLimits()
    assert (limits.horizon_s, limits.start_overhead_s) == (defaults.HORIZON_S, defaults.START_OVERHEAD_S)


def test_a_jobs_default_eps_are_the_defaults() -> None:
    spec = JobSpec(name="j", tenant="t", workload="sim", params={})
    assert (spec.eps_mem, spec.eps_time) == (defaults.EPS_MEM, defaults.EPS_TIME)


@pytest.mark.parametrize("variable", ["SJA_HORIZON_S", "SJA_START_OVERHEAD_S", "SJA_POLICY"])
def test_compose_sets_none_of_them(variable: str) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    blocks = [v for k, v in compose.items() if k.startswith("x-") and isinstance(v, dict)]
    blocks += [svc.get("environment") or {} for svc in compose["services"].values()]
    setting = [b for b in blocks if isinstance(b, dict) and variable in b]
    assert setting == [], f"docker-compose.yml sets {variable}"
