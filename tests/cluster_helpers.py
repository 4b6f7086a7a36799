"""Clustered servers on loopback for tests/pipeline/test_clusters.py: a 3-node nats-server cluster
with JetStream and a 3-master Redis Cluster (valkey-server / redis-server from
kvtier.harness.embedded's finder). Every node is a child process on free loopback ports, stopped
by its PID; its work directory is removed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import redis

from kvtier.harness.embedded import NatsServer, RedisServer, ServerStartError, find_nats_server, free_port


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (each checked free at allocation time)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


# --- NATS ------------------------------------------------------------------------------------
@dataclass
class NatsClusterNode(NatsServer):
    """One node of a JetStream cluster, configured by a file: client, cluster and monitor
    ports are fixed before start because every node's routes name the others."""

    server_name: str = ""
    cluster_port: int = 0
    routes: list[int] = field(default_factory=list)
    cluster_name: str = "kvtier-test"

    def _command(self) -> list[str]:
        store = os.path.join(self.workdir, "jetstream")
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in self.routes)
        config = (
            f'server_name: "{self.server_name}"\n'
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.monitor_port}\n"
            f'jetstream {{ store_dir: "{store}" }}\n'
            f'cluster {{ name: "{self.cluster_name}", listen: 127.0.0.1:{self.cluster_port}, routes: [{routes}] }}\n'
        )
        path = os.path.join(self.workdir, f"{self.server_name}.conf")
        with open(path, "w") as f:
            f.write(config)
        return [find_nats_server(), "-c", path]

    def monitor(self, endpoint: str, timeout: float = 1.0) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/{endpoint}", timeout=timeout) as r:
            return json.loads(r.read())

    def healthy(self) -> bool:
        """JetStream up and this node current with the cluster's meta group."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False


class NatsCluster:
    """Three nats-server nodes on loopback, full mesh of routes, JetStream on each."""

    def __init__(self, size: int = 3):
        self.workdir = tempfile.mkdtemp(prefix="kvtier-nats-cluster-")
        ports = _free_ports(3 * size)
        client, cluster, monitor = ports[:size], ports[size:2 * size], ports[2 * size:]
        self.nodes = [
            NatsClusterNode(name=f"nats-n{i}", port=client[i], monitor_port=monitor[i], server_name=f"n{i}",
                            cluster_port=cluster[i], routes=[p for j, p in enumerate(cluster) if j != i],
                            workdir=os.path.join(self.workdir, f"n{i}"))
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node, comma-separated: the form kvtier's --nats takes for a cluster."""
        return ",".join(n.url for n in self.nodes)

    def node(self, server_name: str) -> NatsClusterNode:
        return next(n for n in self.nodes if n.server_name == server_name)

    def connected_to(self, client_name: str) -> str:
        """The server name of the node a client (by its connection name) is connected to."""
        for node in self.nodes:
            with contextlib.suppress(OSError):
                if any(c.get("name") == client_name for c in node.monitor("connz?limit=1024").get("connections", [])):
                    return node.server_name
        raise LookupError(f"no node has a client named {client_name!r}")

    def start(self, timeout: float = 30.0) -> NatsCluster:
        try:
            for node in self.nodes:
                os.makedirs(node.workdir, exist_ok=True)
                node.start()
            deadline = time.monotonic() + timeout
            while not all(n.healthy() for n in self.nodes):
                if time.monotonic() > deadline:
                    raise ServerStartError("NATS cluster never became healthy:\n"
                                           + "\n".join(f"{n.server_name}: {n.tail_log(8)}" for n in self.nodes))
                time.sleep(0.1)
        except BaseException:
            self.cleanup()
            raise
        return self

    def cleanup(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


# --- Redis Cluster ---------------------------------------------------------------------------
SLOTS = 16384


@dataclass
class RedisClusterNode(RedisServer):
    """A Redis-protocol server in cluster mode. The cluster bus port is chosen explicitly
    (`--cluster-port`): the default, port + 10000, may be past 65535 for an ephemeral port."""

    name: str = "redis-cluster-node"
    bus_port: int = 0
    node_timeout_ms: int = 2000

    def _command(self) -> list[str]:
        self.bus_port = self.bus_port or free_port()
        return [*super()._command(), "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(self.workdir, "nodes.conf"),
                "--cluster-port", str(self.bus_port), "--cluster-node-timeout", str(self.node_timeout_ms)]

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


class RedisCluster:
    """Three masters, no replicas: slots split in three contiguous ranges, nodes met through
    CLUSTER MEET, ready once every node reports cluster_state:ok and sees all three masters."""

    def __init__(self, size: int = 3):
        self.workdir = tempfile.mkdtemp(prefix="kvtier-redis-cluster-")
        self.nodes = [RedisClusterNode(name=f"redis-n{i}", workdir=os.path.join(self.workdir, f"n{i}"))
                      for i in range(size)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> RedisCluster:
        try:
            for node in self.nodes:
                os.makedirs(node.workdir, exist_ok=True)
                node.start()
            size = len(self.nodes)
            for i, node in enumerate(self.nodes):
                lo, hi = i * SLOTS // size, (i + 1) * SLOTS // size - 1
                with contextlib.closing(node.client()) as c:
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            with contextlib.closing(self.nodes[0].client()) as c:
                for node in self.nodes[1:]:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
            deadline = time.monotonic() + timeout
            while not self._ready():
                if time.monotonic() > deadline:
                    raise ServerStartError("Redis Cluster never reached cluster_state:ok:\n"
                                           + "\n".join(f"{n.name}: {n.tail_log(8)}" for n in self.nodes))
                time.sleep(0.1)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _ready(self) -> bool:
        for node in self.nodes:
            with contextlib.closing(node.client()) as c:
                info = c.execute_command("CLUSTER", "INFO")
                info = info.decode() if isinstance(info, bytes) else info
                if "cluster_state:ok" not in info or f"cluster_known_nodes:{len(self.nodes)}" not in info:
                    return False
                if len(c.execute_command("CLUSTER", "SLOTS")) != len(self.nodes):
                    return False
        return True

    def node_of_key(self, key: str) -> RedisClusterNode:
        """The master serving `key`'s slot."""
        with contextlib.closing(self.nodes[0].client()) as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
        return self._owner(slot)

    def _owner(self, slot: int) -> RedisClusterNode:
        with contextlib.closing(self.nodes[0].client()) as c:
            for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no master serves slot {slot}")

    def cleanup(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
