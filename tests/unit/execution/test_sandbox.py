"""The subjob sandbox's pieces without a subjob: its environment's allow-list, its settings, and
what the executor says where it cannot be made (the attacks are in
``tests/integration/executor/test_sandbox_attacks.py``)."""

from __future__ import annotations

import pytest

from sja.bus.settings import SettingsError
from sja.execution import sandbox as sbx
from sja.execution.sandbox_init import WORK_AT


def test_the_environment_is_an_allow_list_never_the_executors() -> None:
    executor = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "SJA_NATS_PASSWORD": "secret",
        "SJA_NATS_USER": "sja-executor",
        "RAY_AUTH_TOKEN": "token",
        "AWS_SECRET_ACCESS_KEY": "key",
        "HOME": "/var/lib/sja",
        "OPERATOR_VAR": "x",
    }
    env = sbx.environment({"SJA_UNITS": "3"}, {"HF_HOME": "/data/hf"}, ("OPERATOR_VAR",), source=executor)
    assert env == {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "OPERATOR_VAR": "x",
        "HF_HOME": "/data/hf",
        "SJA_UNITS": "3",
        "HOME": WORK_AT,
    }


def test_settings_are_read_with_sja_sandbox_as_the_switch() -> None:
    s = sbx.settings_from_env({"SJA_SANDBOX": "off", "SJA_SANDBOX_NPROC": "64", "SJA_SANDBOX_HIDE": "/a,/b"})
    assert (s.mode, s.nproc, s.hide) == ("off", 64, ("/a", "/b"))
    assert sbx.settings_from_env({}) == sbx.SandboxSettings()
    with pytest.raises(SettingsError, match="SJA_SANDBOX_NETWORK"):
        sbx.settings_from_env({"SJA_SANDBOX_NETWORK": "everywhere"})


def test_where_namespaces_cannot_be_made_the_executor_is_told_what_to_grant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sbx, "is_root", lambda: False)
    monkeypatch.setattr(sbx, "_unshare", lambda: "/bin/false")  # as unshare refused by the kernel
    with pytest.raises(sbx.SandboxError) as e:
        sbx.check(sbx.SandboxSettings())
    assert "cannot create the subjob sandbox" in str(e.value)
    assert "unprivileged user namespaces" in str(e.value) and "SJA_SANDBOX=off" in str(e.value)
    assert "\n" not in str(e.value)
    sbx.check(sbx.SandboxSettings(mode="off"))  # nothing to check: the operator said so


def test_the_start_line_says_when_uids_cannot_be_switched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sbx, "is_root", lambda: True)
    assert "uids 200000..200003 (one per slice)" in sbx.describe(sbx.SandboxSettings(), 4)
    monkeypatch.setattr(sbx, "is_root", lambda: False)
    assert "cannot switch uids" in sbx.describe(sbx.SandboxSettings(), 4)
    assert sbx.describe(sbx.SandboxSettings(mode="off")).startswith("SANDBOX OFF")
    assert "HOST'S NETWORK" in sbx.describe(sbx.SandboxSettings(network="host"))


def test_a_home_of_slash_hides_nothing_the_system_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/")
    box = sbx.Sandbox(sbx.SandboxSettings(hide=("/etc", "/srv/secrets")), hidden=("/var/lib/sja/out",))
    assert box.hidden == ("/root", "/var/lib/sja/out", "/srv/secrets")
