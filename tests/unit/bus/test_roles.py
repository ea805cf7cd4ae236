"""The NATS users and permissions are described once (``sja.bus.roles``): the deployment's
``infra/nats/auth.conf`` is that description's output, and ``sja up``'s server gets the same
permissions with its own passwords."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sja.bus import roles
from sja.protocol import subjects

ROOT = Path(__file__).resolve().parents[3]
AUTH_CONF = ROOT / "infra" / "nats" / "auth.conf"


def permissions(conf: str) -> dict[str, tuple[set[str], set[str], bool]]:
    """user -> (publish allowed, subscribe allowed, allow_responses), read from a configuration."""
    text = re.sub(r"#.*", "", conf)
    out = {}
    for found in re.finditer(r"user:\s*(\S+)(.*?)(?=user:|\Z)", text, re.S):
        body = found.group(2)
        pub = re.search(r"publish:\s*\{\s*allow:\s*\[(.*?)\]", body, re.S)
        sub = re.search(r"subscribe:\s*\{\s*allow:\s*\[(.*?)\]", body, re.S)
        assert pub and sub, found.group(1)
        out[found.group(1)] = (
            set(re.findall(r'"([^"]+)"', pub.group(1))),
            set(re.findall(r'"([^"]+)"', sub.group(1))),
            "allow_responses: true" in body,
        )
    return out


def test_the_deployment_file_is_generated_from_the_roles() -> None:
    assert AUTH_CONF.read_text(encoding="utf-8") == roles.deployment_auth_conf(), (
        "infra/nats/auth.conf is out of date: python -m sja.bus.roles > infra/nats/auth.conf"
    )


def test_sja_up_grants_what_the_deployment_grants() -> None:
    users = roles.roles(roles.DEPLOYMENT_TENANTS)
    passwords = roles.generate_passwords(users)
    generated = permissions(roles.authorization_block(users, passwords))
    assert generated == permissions(AUTH_CONF.read_text(encoding="utf-8"))
    for role in users:
        assert f'password: "{passwords[role.user]}"' in roles.authorization_block([role], passwords)


def test_a_tenant_gets_only_its_own_requests_and_inbox() -> None:
    role = roles.tenant_role("alpha")
    assert set(role.publish) == {subjects.tenant_request(r, "alpha") for r in subjects.JOB_REQUESTS}
    assert role.subscribe == ("_INBOX.tenant-alpha.>",)
    assert not role.allow_responses
    assert not any(p.startswith("$") for p in role.publish)  # no JetStream, KV or object store


def test_no_role_but_the_executor_publishes_completions_and_the_clearer_grants() -> None:
    every = roles.roles(roles.DEPLOYMENT_TENANTS)
    completing = [r.user for r in every if any(p.startswith("sja.v1.subjob.completed") for p in r.publish)]
    granting = [r.user for r in every if any(p.startswith("sja.v1.grant.issued") for p in r.publish)]
    assert completing == ["sja-executor"] and granting == ["sja-clearer"]
    checkpoints = [r.user for r in every if any("OBJ_sja-checkpoints" in p for p in r.publish)]
    assert sorted(checkpoints) == ["sja-executor", "sja-gateway"]


@pytest.mark.parametrize("name", ["", "a.b", "a b", "x" * 65, "*", ">"])
def test_a_tenant_name_that_is_no_subject_token_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="bad tenant name"):
        roles.tenant_role(name)


def test_passwords_are_fresh_and_strong() -> None:
    users = roles.roles(("alpha",))
    a, b = roles.generate_passwords(users), roles.generate_passwords(users)
    assert all(len(p) >= 43 and a[u] != b[u] for u, p in a.items())
    assert len(set(a.values())) == len(a)
