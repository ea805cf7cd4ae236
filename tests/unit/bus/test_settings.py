"""Settings are read from the environment mapping they are given, once: the NATS group variable by
variable (``SJA_NATS_*``), lists and mappings parsed from their text, and every value validated
then, a bad one failing with the variable it came from."""

from __future__ import annotations

import msgspec
import pytest

from sja.bus.auth import NatsSettings
from sja.bus.settings import BaseSettings, Pools, SettingsError, TenantBudgets, TenantShares, Weights3


class Example(BaseSettings, frozen=True, kw_only=True):
    pools: Pools = ()
    tenant_shares: TenantShares = msgspec.field(default_factory=dict)
    tenant_budgets: TenantBudgets = msgspec.field(default_factory=dict)
    weights: Weights3 = (0.5, 0.3, 0.2)


def test_the_nats_group_reads_its_own_variables() -> None:
    s = BaseSettings.from_env(
        {
            "SJA_NATS_URL": "tls://n:4222",
            "SJA_NATS_USER": "sja-agent",
            "SJA_NATS_PASSWORD": "sekrit",
            "SJA_NATS_CREDS": "/c.creds",
            "SJA_NATS_TLS_CA": "/ca.pem",
            "SJA_NATS_INBOX_PREFIX": "_INBOX.x",
        }
    )
    assert s.nats_url == "tls://n:4222"
    assert s.nats == NatsSettings(
        user="sja-agent", password="sekrit", creds="/c.creds", tls_ca="/ca.pem", inbox_prefix="_INBOX.x"
    )
    assert "sekrit" not in repr(s), "the password never shows in a repr"
    assert BaseSettings.from_env({}).nats == NatsSettings()
    assert not BaseSettings.from_env({}).nats.configured


def test_command_line_options_override_the_environment_where_given() -> None:
    nats = BaseSettings.from_env({"SJA_NATS_USER": "a", "SJA_NATS_PASSWORD": "p"}).nats
    assert nats.with_overrides(user="b", password="") == NatsSettings(user="b", password="p")
    assert nats.with_overrides() is nats


def test_lists_and_mappings_are_parsed_when_the_settings_are_built() -> None:
    s = Example.from_env(
        {
            "SJA_POOLS": "rack-a, rack-b,",
            "SJA_TENANT_SHARES": "alpha=3, beta=0.5",
            "SJA_TENANT_BUDGETS": "alpha=0,beta=12",
            "SJA_WEIGHTS": "1,0,0",
        }
    )
    assert s.pools == ("rack-a", "rack-b")
    assert s.tenant_shares == {"alpha": 3.0, "beta": 0.5}
    assert s.tenant_budgets == {"alpha": 0.0, "beta": 12.0}
    assert s.weights == (1.0, 0.0, 0.0)
    empty = Example.from_env({"SJA_POOLS": "", "SJA_TENANT_SHARES": ""})
    assert empty.pools == () and empty.tenant_shares == {} and empty.weights == (0.5, 0.3, 0.2)
    # An override given as text is read as the variable would be.
    assert Example.from_env({}, pools="x,y").pools == ("x", "y")


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SJA_TENANT_SHARES": "alpha=0"}, "SJA_TENANT_SHARES"),
        ({"SJA_TENANT_SHARES": "alpha=-1"}, "SJA_TENANT_SHARES"),
        ({"SJA_TENANT_SHARES": "alpha=lots"}, "SJA_TENANT_SHARES"),
        ({"SJA_TENANT_SHARES": "alpha"}, "SJA_TENANT_SHARES"),
        ({"SJA_TENANT_SHARES": "=1"}, "SJA_TENANT_SHARES"),
        ({"SJA_TENANT_BUDGETS": "alpha=-1"}, "SJA_TENANT_BUDGETS"),
        ({"SJA_WEIGHTS": "0.5,0.5"}, "SJA_WEIGHTS"),
        ({"SJA_WEIGHTS": "0.5,-0.3,0.2"}, "SJA_WEIGHTS"),
        ({"SJA_METRICS_PORT": "70000"}, "SJA_METRICS_PORT"),
    ],
)
def test_a_bad_value_fails_naming_its_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(SettingsError, match=f"bad setting {variable}"):
        Example.from_env(env)


def test_every_variable_is_listed_with_its_default() -> None:
    variables = dict(Example.variables())
    assert variables["SJA_NATS_URL"] == "nats://127.0.0.1:4222"
    assert variables["SJA_NATS_USER"] == "" and variables["SJA_NATS_TLS_KEY"] == ""
    assert "SJA_NATS" not in variables, "a group is read variable by variable"
    assert variables["SJA_POOLS"] == () and variables["SJA_TENANT_SHARES"] == {}
    assert variables["SJA_WEIGHTS"] == (0.5, 0.3, 0.2)
