"""A real Redis Cluster for tests: 3 masters and 3 replicas from the same `redis-server` binary.

Why real: slot routing, MOVED after a failover and per-slot scripts are what cluster mode is about;
only the server shows them. Each node runs on its own loopback port; the cluster bus takes that
port + 10000, so ports stay at or below 55535. `--cluster-replica-validity-factor 0` lets a replica
take over however long it was cut off (the default refuses after a while on a busy test machine);
the node timeout is short so a test sees a failover in a few seconds. A node whose port or bus port
was taken between the pick and its start (the bus port lies in the kernel's ephemeral range, where
every client socket of a busy machine takes ports) exits at once: the whole start is then tried
again on other ports. Every node requires a
password (so the cluster tests also show a password in the URL works), and with `tls` the nodes
speak only TLS, to clients, to each other and to their replicas.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import redis

from microturn.processes import free_port
from tests.shared.redis_servers import REDIS_SERVER, ServerUnavailable, answers_ping
from tests.shared.tls import Certificate, self_signed

logger = logging.getLogger(__name__)

NODES: Final = 6
BUS_PORT_OFFSET: Final = 10000  # a node's cluster bus listens on its port + 10000
MAX_PORT: Final = 65535 - BUS_PORT_OFFSET
NODE_TIMEOUT_MS: Final = 1500
_START_TIMEOUT_S: Final = 20.0
_START_ATTEMPTS: Final = 3


PASSWORD: Final = "cluster-pw"


@dataclass
class Cluster:
    ports: list[int]
    tls: Certificate | None = None
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """A live seed node's URL (any would do), with the password (and the CA, with TLS). A client
        that started before a node died knows the others; a new one must be seeded by a live one."""
        seed = next(port for port in self.ports if port in self.procs)
        scheme, query = ("rediss", "?" + self.tls.query()) if self.tls is not None else ("redis", "")
        return f"{scheme}://:{PASSWORD}@127.0.0.1:{seed}/0{query}"

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster.from_url(self.url)

    def master_of(self, key: str) -> int:
        """The port of the master serving `key`'s slot now."""
        with contextlib.closing(self.client()) as client:
            node = client.get_node_from_key(key)
            assert node is not None
            return int(node.port)

    def kill(self, port: int) -> None:
        """SIGKILL one node (no shutdown, no last writes to its replica)."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ports(count: int) -> list[int]:
    """Free ports whose cluster bus port is free too (now: a start that loses a race is retried)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port <= MAX_PORT and port not in ports and _bindable(port + BUS_PORT_OFFSET):
            ports.append(port)
    return ports


def _stop_nodes(cluster: Cluster) -> None:
    for proc in cluster.procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in cluster.procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _cluster_ok(port: int, tls: Certificate | None) -> bool:
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        password=PASSWORD,
        socket_timeout=1,
        ssl=tls is not None,
        ssl_ca_certs=None if tls is None else str(tls.cert),
    )
    try:
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text
    except redis.RedisError:
        return False
    finally:
        client.close()


@contextlib.contextmanager
def running_cluster(workdir: Path, *, tls: bool = False) -> Iterator[Cluster]:
    """Six nodes, joined as 3 masters with one replica each; all stopped on exit."""
    binary = shutil.which(REDIS_SERVER)
    cli = shutil.which("redis-cli")
    if binary is None or cli is None:
        raise ServerUnavailable(f"{REDIS_SERVER} or redis-cli is not installed")
    certificate = self_signed(workdir) if tls else None
    if tls and certificate is None:
        raise ServerUnavailable("openssl is not installed: no certificate for a TLS cluster")
    for attempt in range(1, _START_ATTEMPTS + 1):
        cluster = Cluster(_ports(NODES), certificate)
        if _start_nodes(cluster, workdir, binary):
            break
        _stop_nodes(cluster)
        logger.warning("a cluster node exited at start (attempt %d); logs in %s", attempt, workdir)
    else:
        raise RuntimeError(f"cluster nodes did not start in {_START_ATTEMPTS} attempts; logs in {workdir}")
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        nodes = [f"127.0.0.1:{port}" for port in cluster.ports]
        tls_flags = [] if certificate is None else ["--tls", "--cacert", str(certificate.cert)]
        create = ["--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"]
        subprocess.run(
            [cli, *tls_flags, "-a", PASSWORD, *create],
            check=True,
            capture_output=True,
            timeout=60,
        )
        while not all(_cluster_ok(port, certificate) for port in cluster.ports):
            if time.monotonic() > deadline + 30:
                raise RuntimeError(f"the cluster did not become ok; logs in {workdir}")
            time.sleep(0.1)
        logger.info("redis cluster up on ports %s", cluster.ports)
        yield cluster
    finally:
        _stop_nodes(cluster)


def _start_nodes(cluster: Cluster, workdir: Path, binary: str) -> bool:
    """Start every node and wait until each answers; False as soon as one has exited (a port of
    its was taken), RuntimeError if they are still silent after the start timeout."""
    certificate = cluster.tls
    for port in cluster.ports:
        node_dir = workdir / f"cluster-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0"]
        args += ["--requirepass", PASSWORD, "--masterauth", PASSWORD]
        if certificate is not None:
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes"]
            args += ["--tls-cert-file", str(certificate.cert), "--tls-key-file", str(certificate.key)]
            args += ["--tls-ca-cert-file", str(certificate.cert), "--tls-auth-clients", "no"]
        with open(node_dir / "redis.log", "wb") as log:
            cluster.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not all(answers_ping(port, PASSWORD, certificate) for port in cluster.ports):
        if any(proc.poll() is not None for proc in cluster.procs.values()):
            return False
        if time.monotonic() > deadline:
            _stop_nodes(cluster)
            raise RuntimeError(f"cluster nodes did not answer in {_START_TIMEOUT_S:g} s; logs in {workdir}")
        time.sleep(0.05)
    return True
