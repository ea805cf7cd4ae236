"""TLS as the deployment turns it on: ``infra/nats/nats.conf`` with its ``include ./tls.conf`` line
enabled and ``tls.conf``'s mutual-TLS lines uncommented, together with ``auth.conf``'s users, run by
a real nats-server (only the certificate directory, ``/etc/nats/tls`` in the container, points at
test certificates made with openssl). A service connects with its user, password and client
certificate over ``tls://`` and serves; a tenant submits over TLS; no certificate, no TLS, or a
wrong password is refused."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.gateway.service import GatewayService, GatewaySettings
from sja.bus.auth import NatsAuthError, NatsSettings
from sja.bus.connection import connect
from sja.bus.natsd import EmbeddedNats
from sja.client import SjaClient
from sja.protocol.messages import JobSpec
from tests.integration.bus.test_security import ROLES

ROOT = Path(__file__).resolve().parents[3]
NATS_DIR = ROOT / "infra" / "nats"
CONTAINER_TLS_DIR = "/etc/nats/tls/"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as tls.conf names them."""
    d.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=sja-ca", cwd=d
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        openssl(
            "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=sja-{name}", cwd=d
        )
        (d / f"{name}.ext").write_text(ext + "\n", encoding="utf-8")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext", cwd=d,
        )  # fmt: skip


def enable_tls(conf: Path, certs: Path) -> None:
    """What docs/deployment.md ("TLS") tells an operator to do, on a copy of infra/nats."""
    shutil.copytree(NATS_DIR, conf)
    nats_conf = conf / "nats.conf"
    text = nats_conf.read_text(encoding="utf-8")
    assert "\n# include ./tls.conf\n" in text, "nats.conf has the TLS include to uncomment"
    nats_conf.write_text(text.replace("\n# include ./tls.conf\n", "\ninclude ./tls.conf\n"), encoding="utf-8")
    tls_conf = conf / "tls.conf"
    text = tls_conf.read_text(encoding="utf-8")
    for line in ("# ca_file:", "# verify: true"):
        assert line in text, f"tls.conf has {line!r} to uncomment for mutual TLS"
        text = text.replace(line, line.removeprefix("# "))
    assert text.count(CONTAINER_TLS_DIR) == 3, "certificate, key and CA under /etc/nats/tls"
    tls_conf.write_text(text.replace(CONTAINER_TLS_DIR, f"{certs}/"), encoding="utf-8")


@dataclass
class TlsServer:
    server: EmbeddedNats
    passwords: dict[str, str]
    certs: Path

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.server.port}"

    def auth(self, user: str, role: str, *, cert: bool = True) -> NatsSettings:
        return NatsSettings(
            user=user,
            password=self.passwords[role],
            tls_ca=str(self.certs / "ca.crt"),
            tls_cert=str(self.certs / "client.crt") if cert else "",
            tls_key=str(self.certs / "client.key") if cert else "",
        )


@pytest.fixture
def tls_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TlsServer]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    certs = tmp_path / "tls"
    make_certificates(certs)
    conf = tmp_path / "nats-conf"
    enable_tls(conf, certs)
    passwords = {role: secrets.token_hex(16) for role in ROLES}
    for role, pw in passwords.items():
        monkeypatch.setenv(f"NATS_PASSWORD_{role}", pw)  # read by nats-server (auth.conf)
    server = EmbeddedNats(
        store_dir=str(tmp_path / "nats"),
        config_file=str(conf / "nats.conf"),
        extra_args=["-m", "0"],
        log_file=str(tmp_path / "nats.log"),
    )
    server.start()
    try:
        yield TlsServer(server, passwords, certs)
    finally:
        server.stop()


async def test_a_service_and_a_tenant_work_over_mutual_tls_with_their_users(
    tls_server: TlsServer, tmp_path: Path
) -> None:
    t = tls_server
    gateway = GatewayService(
        GatewaySettings(
            nats_url=t.url,
            out_dir=str(tmp_path / "out"),
            instance="gateway-tls",
            nats=t.auth("sja-gateway", "GATEWAY"),
        )
    )
    async with gateway:
        assert gateway.bus.is_connected
        # The operator discovers it over TLS, with its own user.
        admin = await connect(t.url, "admin-tls", auth=t.auth("sja-admin", "ADMIN"))
        try:
            msg = await admin.request("$SRV.PING.sja-gateway", b"", timeout=5)
            assert json.loads(msg.data)["metadata"]["instance"] == "gateway-tls"
        finally:
            await admin.close()
        # A tenant submits and reads its job over TLS.
        client = await SjaClient.connect(t.url, tenant="alpha", auth=t.auth("tenant-alpha", "TENANT_ALPHA"))
        try:
            ack = await client.submit(JobSpec(name="tls-job", tenant="alpha", workload="montecarlo"))
            assert (await client.status(ack.job_id)).spec.name == "tls-job"
        finally:
            await client.close()
        assert gateway.permission_violations == 0


async def test_without_a_certificate_without_tls_or_with_a_wrong_password_the_server_refuses(
    tls_server: TlsServer,
) -> None:
    t = tls_server
    # No client certificate: the server's `verify: true` fails the handshake.
    with pytest.raises(TimeoutError):  # the client retries a failing handshake until it gives up
        await asyncio.wait_for(connect(t.url, "no-cert", auth=t.auth("sja-agent", "AGENT", cert=False)), 3)
    # Plain TCP to a TLS-only server.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            connect(
                f"nats://127.0.0.1:{t.server.port}",
                "plain",
                auth=NatsSettings(user="sja-agent", password=t.passwords["AGENT"]),
            ),
            3,
        )
    # The certificate is not a login: auth.conf still checks the user's password.
    wrong = NatsSettings(
        user="sja-agent",
        password="not-the-password",
        tls_ca=str(t.certs / "ca.crt"),
        tls_cert=str(t.certs / "client.crt"),
        tls_key=str(t.certs / "client.key"),
    )
    with pytest.raises(NatsAuthError):
        await asyncio.wait_for(connect(t.url, "wrong-password", auth=wrong), 10)
