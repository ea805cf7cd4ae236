"""The services' pools, nodes, tenant shares, budgets and weights are typed settings: read and checked
when the settings are built (``SJA_*``), so a bad value stops ``sja service`` at start with one line
naming the variable, and the services use the parsed values as they are."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.advertiser.service import AdvertiserSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.inventory.service import InventorySettings
from services.ui.service import UiSettings
from sja.bus.settings import SettingsError


def test_the_clearer_takes_its_parsed_settings_as_they_are() -> None:
    settings = ClearerSettings.from_env(
        {
            "SJA_POOLS": "pool-a,pool-b",
            "SJA_TENANT_SHARES": "alpha=3,beta=1",
            "SJA_TENANT_BUDGETS": "alpha=10",
            "SJA_JASDA_WEIGHTS": "0.2,0.2,0.6",
        }
    )
    clearer = ClearerService(settings)
    assert clearer.pools == ["pool-a", "pool-b"]
    assert clearer.ledger.tenant_shares == {"alpha": 3.0, "beta": 1.0}
    assert clearer.ledger.tenant_budgets == {"alpha": 10.0}
    assert clearer.policy_config.jasda_weights == (0.2, 0.2, 0.6)
    clearer.ledger.tenant_budgets["alpha"] -= 4.0
    assert settings.tenant_budgets == {"alpha": 10.0}, "charging the ledger leaves the settings as read"


def test_advertiser_and_ui_read_the_same_kinds() -> None:
    assert AdvertiserSettings.from_env({"SJA_POOLS": "node0"}).pools == ("node0",)
    assert UiSettings.from_env({"SJA_TENANT_SHARES": "a=1"}).tenant_shares == {"a": 1.0}
    with pytest.raises(SettingsError, match="SJA_TENANT_SHARES"):
        UiSettings.from_env({"SJA_TENANT_SHARES": "a=0"})
    assert InventorySettings.from_env({"SJA_NODES": "n1, n2"}).nodes == ("n1", "n2")
    assert InventorySettings.from_env({}).nodes == ()


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SJA_TENANT_SHARES", "alpha=0"), ("SJA_JASDA_WEIGHTS", "1,2"), ("SJA_TENANT_BUDGETS", "alpha=-5")],
)
def test_sja_service_with_a_bad_value_exits_with_one_line_naming_it(variable: str, value: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "OTEL_"))}
    # No server at this URL: the settings fail before any connection is tried.
    env.update({variable: value, "SJA_NATS_URL": "nats://127.0.0.1:1"})
    done = subprocess.run(
        [sys.executable, "-m", "sja.cli.main", "service", "clearer"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: bad setting {variable}"), done.stderr
