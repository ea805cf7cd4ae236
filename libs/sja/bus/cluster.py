"""A nats-server cluster on loopback: N ``EmbeddedNats`` processes with JetStream, joined by routes.

Each node has its own ``server_name``, client port, cluster (route) port, optional monitoring port and
store directory (JetStream and the store come from ``EmbeddedNats``'s ``-js -sd`` flags, which is why
the config has no ``jetstream`` block); a generated config holds the ``cluster`` block with every
node's route, so the
servers form one JetStream cluster (a meta leader elected by Raft) and streams can have replicas.
Used by the cluster test (a server killed under load) and by benchmarks; one machine, no TLS, no auth.

    cluster = NatsCluster(size=3, base_dir="out/nats-cluster").start()
    LocalStack(out_dir=..., nats_url=cluster.url)   # "nats://127.0.0.1:a,nats://127.0.0.1:b,..."
    cluster.kill(cluster.index_of("sja-n1"))        # SIGKILL, store kept
    cluster.restart(1)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sja.bus.natsd import EmbeddedNats, free_port


@dataclass
class ClusterNode:
    name: str
    port: int
    cluster_port: int
    monitor_port: int
    store_dir: str
    config_file: str
    log_file: str
    server: EmbeddedNats

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        proc = self.server.proc
        return proc is not None and proc.poll() is None

    def varz(self, endpoint: str = "varz", timeout_s: float = 2.0) -> dict[str, object]:
        """A monitoring endpoint of this node (``varz``, ``jsz``, ``routez``, ``healthz``...)."""
        if not self.monitor_port:
            raise RuntimeError(f"node {self.name} runs without a monitoring port")
        url = f"http://127.0.0.1:{self.monitor_port}/{endpoint}"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            data: dict[str, object] = json.loads(resp.read())
            return data


@dataclass
class NatsCluster:
    """``size`` nats-server processes with JetStream clustered over routes on 127.0.0.1."""

    size: int = 3
    base_dir: str = ""
    name: str = "sja"
    monitor: bool = True
    max_payload: int = 0
    """Bytes; 0: the server's default (1 MiB)."""
    nodes: list[ClusterNode] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what ``sja.bus.connection.connect`` takes)."""
        return ",".join(self.urls)

    def _layout(self) -> None:
        if self.nodes:
            return
        if self.size < 1:
            raise ValueError("a cluster needs at least one node")
        if not self.base_dir:
            self._tmp = tempfile.TemporaryDirectory(prefix="sja-nats-cluster-")
            self.base_dir = self._tmp.name
        base = Path(self.base_dir)
        base.mkdir(parents=True, exist_ok=True)
        ports = [(free_port(), free_port(), free_port() if self.monitor else 0) for _ in range(self.size)]
        routes = ", ".join(f'"nats-route://127.0.0.1:{cp}"' for _, cp, _ in ports)
        for i, (port, cport, mport) in enumerate(ports):
            name = f"{self.name}-n{i}"
            store = base / name / "store"
            store.mkdir(parents=True, exist_ok=True)
            conf = base / name / "nats.conf"
            lines = [
                f'server_name: "{name}"',
                f"port: {port}",
                'host: "127.0.0.1"',
                "cluster {",
                f'  name: "{self.name}"',
                f'  listen: "127.0.0.1:{cport}"',
                f"  routes: [{routes}]",
                "}",
            ]
            if mport:
                lines.append(f'http: "127.0.0.1:{mport}"')
            if self.max_payload:
                lines.append(f"max_payload: {self.max_payload}")
            conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
            log = str(base / name / "nats.log")
            server = EmbeddedNats(port=port, store_dir=str(store), config_file=str(conf), log_file=log)
            self.nodes.append(ClusterNode(name, port, cport, mport, str(store), str(conf), log, server))

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        """Start every node and wait until JetStream answers through each of them."""
        self._layout()
        try:
            for node in self.nodes:
                node.server.start(timeout_s=timeout_s)
            asyncio.run(self.wait_jetstream(timeout_s=timeout_s))
        except BaseException:
            self.stop()
            raise
        return self

    async def wait_jetstream(self, timeout_s: float = 30.0) -> None:
        """Until the cluster has a JetStream meta leader and every live node answers account info."""
        import nats

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        for node in self.nodes:
            if not node.alive:
                continue
            while True:
                try:
                    nc = await nats.connect(node.url, connect_timeout=2, allow_reconnect=False)
                    try:
                        await nc.jetstream().account_info()
                    finally:
                        await nc.close()
                    break
                except Exception as e:  # no meta leader yet: JetStream not ready
                    last = e
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"JetStream not ready on {node.name}: {last}") from None
                    await asyncio.sleep(0.2)

    def index_of(self, server_name: str) -> int:
        for i, n in enumerate(self.nodes):
            if n.name == server_name:
                return i
        raise KeyError(server_name)

    def kill(self, index: int) -> ClusterNode:
        """SIGKILL one node (its store stays, for ``restart``)."""
        node = self.nodes[index]
        node.server.kill()
        return node

    def restart(self, index: int, timeout_s: float = 30.0) -> ClusterNode:
        node = self.nodes[index]
        node.server.start(timeout_s=timeout_s)
        return node

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
