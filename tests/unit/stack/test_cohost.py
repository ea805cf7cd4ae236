"""Co-hosting: which services one process runs (``sja service a,b``), and how the one-machine stack
lays its processes out when some services share one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from services.registry import START_ORDER, cohosted_instance, parse_cohost, parse_names
from sja.stack import DEFAULT_ORDER, LocalStack, ServiceProc


def test_names_are_read_in_start_order() -> None:
    assert parse_names("clearer") == ["clearer"]
    assert parse_names(" advertiser, clearer ,gateway,inventory") == [
        "inventory",
        "gateway",
        "clearer",
        "advertiser",
    ]
    assert parse_names(",".join(reversed(START_ORDER))) == list(START_ORDER)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "no service named"),
        ("clearer,", "no service named"),
        ("clearer,,advertiser", "no service named"),
        ("clearer,scheduler", "unknown service 'scheduler'"),
        ("clearer,advertiser,clearer", "service 'clearer' named twice"),
    ],
)
def test_a_bad_list_of_services_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_names(spec)


def test_a_cohost_list_names_two_or_more_allowed_services() -> None:
    assert parse_cohost("advertiser,clearer") == ["clearer", "advertiser"]
    for spec in ("clearer", "clearer,executor"):
        with pytest.raises(ValueError, match="two or more of inventory, gateway, clearer, agent, advertiser"):
            parse_cohost(spec, ("inventory", "gateway", "clearer", "agent", "advertiser"))
    with pytest.raises(ValueError, match="unknown service 'nope'"):
        parse_cohost("clearer,nope")


def test_a_cohosted_service_keeps_the_id_it_would_have_alone() -> None:
    assert cohosted_instance("clearer", "0") == "clearer-0"
    assert cohosted_instance("advertiser", "host-12") == "advertiser-host-12"


def test_the_stack_runs_a_group_where_its_first_member_starts(tmp_path: Path) -> None:
    stack = LocalStack(out_dir=tmp_path, groups=[["advertiser", "inventory", "clearer", "gateway"]])
    assert stack.processes(DEFAULT_ORDER) == ["inventory,gateway,clearer,advertiser", "agent", "executor"]
    pair = LocalStack(out_dir=tmp_path, groups=[["clearer", "advertiser"]])
    assert pair.processes(DEFAULT_ORDER) == [
        "inventory",
        "gateway",
        "clearer,advertiser",
        "agent",
        "executor",
    ]
    env = pair.service_environment("clearer,advertiser", "clearer,advertiser-0")
    assert env["SJA_INSTANCE"] == "0", "each service is named <service>-0, as it would be alone"
    proc = ServiceProc("clearer,advertiser", "clearer,advertiser-0", subprocess.Popen(["true"]), tmp_path)
    proc.proc.wait()
    assert proc.instances == ["clearer-0", "advertiser-0"]


@pytest.mark.parametrize(
    ("groups", "replicas", "message"),
    [
        ([["clearer", "scheduler"]], {}, "'scheduler' is not among"),
        ([["clearer", "advertiser"], ["advertiser", "agent"]], {}, "'advertiser' is in two"),
        ([["clearer", "advertiser"]], {"clearer": 2}, "runs one replica, not 2"),
    ],
)
def test_a_bad_group_is_refused_before_anything_starts(
    tmp_path: Path, groups: list[list[str]], replicas: dict[str, int], message: str
) -> None:
    stack = LocalStack(out_dir=tmp_path, groups=groups, replicas=replicas)
    with pytest.raises(ValueError, match=message):
        stack.start()
    assert stack.nats is None and not stack.procs
