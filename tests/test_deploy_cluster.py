"""The Redis Cluster of k8s/overlays/cluster as its pods and its Job run it, outside a
cluster.

Three redis-server processes start with the StatefulSet's own script, configuration and
environment, each on a loopback address of its own (as pods have their own IPs) and all on
one port; the Job's own script forms them into a cluster, and running it again changes
nothing; after every node has restarted on a new address, as pods do, the nodes find each
other again and serve the data they had. This machine has no cluster DNS, so the scripts'
`getent hosts` answers from a table the test keeps (a pod's name resolves once it has an
address).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from gemq.running.embedded import find_redis_server
from gemq.state.connection import connect
from tests.deploy_helpers import K8S, REAL_SECRETS, Manifests, _render
from tests.helpers import wait_for

NODES = "gemq-redis-cluster"
JOB = "gemq-redis-cluster-create"
PASSWORD = REAL_SECRETS["redis-password"]

GETENT = """#!/bin/sh
[ "$1" = hosts ] || exit 1
awk -v name="$2" '$2 == name {{ print; found = 1; exit }} END {{ exit !found }}' {table}
"""


@pytest.fixture(scope="module")
def overlay() -> Manifests:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not on PATH: the cluster's scripts and probes need it")
    return _render(K8S / "overlays" / "cluster")


class Pods:
    """The StatefulSet's pods as local processes: a directory per pod standing for its
    volumes, the same port on a loopback address per pod, and the names table."""

    def __init__(self, overlay: Manifests, root: Path) -> None:
        self.overlay = overlay
        self.container = overlay.container(NODES)
        self.replicas: int = overlay.get("StatefulSet", NODES)["spec"]["replicas"]
        self.service: str = overlay.get("StatefulSet", NODES)["spec"]["serviceName"]
        self.root = root
        self.hosts = root / "hosts"
        self.hosts.write_text("")
        bin_dir = root / "bin"
        bin_dir.mkdir()
        (bin_dir / "getent").write_text(GETENT.format(table=self.hosts))
        (bin_dir / "getent").chmod(0o755)
        self.path = os.pathsep.join([str(bin_dir), str(Path(find_redis_server()).parent),
                                     os.environ["PATH"]])
        self.subnet = f"127.{random.randint(100, 250)}.{random.randint(0, 255)}"
        self.port = _free_port_pair([f"{self.subnet}.{i}" for i in (1, 2, 3, 11, 12, 13)])
        self.ips: dict[int, str] = {}
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    def name(self, index: int) -> str:
        return f"{NODES}-{index}"

    def start(self, index: int, ip: str, *, named: bool = True,
              **env: str) -> subprocess.Popen[bytes]:
        """Start pod ``index`` on ``ip``; its name resolves to it from now on if ``named``
        (else from ``name_all``)."""
        self.ips[index] = ip
        if named:
            self._resolve(f"{self.name(index)}.{self.service}", ip)
        argv, files = self._mounted(index)
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (self.root / self.name(index) / "data").mkdir(parents=True, exist_ok=True)
        pod = {"metadata.name": self.name(index), "status.podIP": ip}
        environment = {**self.overlay.environment(self.container, REAL_SECRETS, pod),
                       "PATH": self.path, **env}
        with (self.root / f"{self.name(index)}.log").open("ab") as log:
            self.processes[index] = subprocess.Popen(
                [*argv, "--port", str(self.port), "--bind", ip],
                env=environment, stdout=log, stderr=subprocess.STDOUT)
        return self.processes[index]

    def start_all(self, host: int = 1) -> None:
        for index in range(self.replicas):
            self.start(index, f"{self.subnet}.{host + index}")
        for index in range(self.replicas):
            wait_for(partial(self.answers, index), timeout_s=20, what=self.name(index))

    def name_all(self) -> None:
        for index, ip in self.ips.items():
            self._resolve(f"{self.name(index)}.{self.service}", ip)

    def stop_all(self) -> None:
        """SIGTERM every pod (Redis writes its AOF out); their names stop resolving."""
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            process.wait(30)
        self.hosts.write_text("")

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    def client(self, index: int) -> redis.Redis:
        return redis.Redis(host=self.ips[index], port=self.port, password=PASSWORD,
                           socket_timeout=5, decode_responses=True)

    def url(self, index: int = 0) -> str:
        return f"redis://:{PASSWORD}@{self.ips[index]}:{self.port}/0"

    def cluster_info(self, index: int) -> dict[str, str]:
        with self.client(index) as client:
            text = client.execute_command("CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def formed(self) -> bool:
        """Every node: cluster ok, all slots served, and a live link to every node at its
        current address (right after a restart a node reports ok until its peers time
        out, whether it can reach them or not)."""
        here = {f"{self.ips[i]}:{self.port}" for i in range(self.replicas)}
        for index in range(self.replicas):
            info = self.cluster_info(index)
            if (info["cluster_state"], info["cluster_slots_ok"]) != ("ok", "16384"):
                return False
            with self.client(index) as client:
                rows = [line.split() for line in
                        client.execute_command("CLUSTER", "NODES").splitlines()]
            linked = {row[1].partition("@")[0] for row in rows
                      if "fail" not in row[2] and row[7] == "connected"}
            if linked != here or len(rows) != self.replicas:
                return False
        return True

    def topology(self) -> list[tuple[str, ...]]:
        """What CLUSTER NODES says on every node, without its clocks and link states."""
        rows = []
        for index in range(self.replicas):
            with self.client(index) as client:
                text = client.execute_command("CLUSTER", "NODES")
            for line in text.splitlines():
                node, address, flags, master, _, _, epoch, _, *slots = line.split()
                rows.append((str(index), node, address, flags, master, epoch, *slots))
        return sorted(rows)

    def readiness(self, index: int) -> int:
        """Exit status of the pod's readiness probe, pointed at this pod's address."""
        command = [a.replace("-h 127.0.0.1", f"-h {self.ips[index]} -p {self.port}")
                   for a in self.container["readinessProbe"]["exec"]["command"]]
        env = {"PATH": self.path, "REDISCLI_AUTH": PASSWORD}
        return subprocess.run(command, env=env, timeout=30).returncode

    def run_job(self, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """The Job's container, its REDIS_NODES on this machine's port."""
        container = self.overlay.container(JOB)
        env = self.overlay.environment(container, REAL_SECRETS)
        env["REDIS_NODES"] = env["REDIS_NODES"].replace(":6379", f":{self.port}")
        argv, files = _map_mounts(self.overlay, JOB, container["command"],
                                  self.root / "job")
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return subprocess.run(argv, env={**env, "PATH": self.path}, capture_output=True,
                              text=True, timeout=timeout_s)

    def answers(self, index: int) -> bool:
        if self.processes[index].poll() is not None:
            log = (self.root / f"{self.name(index)}.log").read_text()
            raise AssertionError(f"{self.name(index)} exited: {log[-2000:]}")
        try:
            with self.client(index) as client:
                return bool(client.ping())
        except redis.ConnectionError:
            return False

    def _resolve(self, name: str, ip: str) -> None:
        with self.hosts.open("a") as table:
            table.write(f"{ip} {name}\n")

    def _mounted(self, index: int) -> tuple[list[str], dict[Path, str]]:
        argv = self.container["command"] + self.container["args"]
        return _map_mounts(self.overlay, NODES, argv, self.root / self.name(index))


def _map_mounts(overlay: Manifests, workload: str, argv: list[str],
                root: Path) -> tuple[list[str], dict[Path, str]]:
    """``argv`` and the workload's ConfigMap files with every mount path (volumes and
    configuration alike) moved under ``root``."""
    mounts = sorted((m["mountPath"] for m in overlay.container(workload)["volumeMounts"]),
                    key=len, reverse=True)
    pattern = re.compile(r"(?<![\w/.-])(" + "|".join(map(re.escape, mounts)) + r")(?=/|\s|$)")

    def moved(text: str) -> str:
        return pattern.sub(lambda m: f"{root}{m[1]}", text)

    files = {Path(moved(path)): moved(text)
             for path, text in overlay.config_files(workload).items()}
    return [moved(a) for a in argv], files


def _free_port_pair(ips: list[str]) -> int:
    """A port that, with its cluster bus port (+10000), can be bound on every address."""
    for _ in range(200):
        port = random.randint(10_000, 21_999)
        if all(_bindable(ip, p) for ip in ips for p in (port, port + 10_000)):
            return port
    raise AssertionError("no free port pair on the test's loopback addresses")


def _bindable(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
        return True


@pytest.fixture
def pods(overlay: Manifests, tmp_path: Path) -> Iterator[Pods]:
    pods = Pods(overlay, tmp_path)
    try:
        yield pods
    finally:
        pods.kill_all()


@contextlib.contextmanager
def _gemq_client(url: str) -> Iterator[redis.Redis]:
    """gemq's own client for ``url`` (a cluster client for a cluster node), every socket
    closed afterwards: a cluster client's close() leaves its nodes' pools connected."""
    client = connect(url, wait_s=10)
    try:
        yield client
    finally:
        client.close()
        if isinstance(client, RedisCluster):
            client.disconnect_connection_pools()


def _config(client: redis.Redis, name: str) -> Any:
    return client.config_get(name)[name]


def test_a_node_refuses_the_placeholder_password(pods: Pods) -> None:
    process = pods.start(0, f"{pods.subnet}.1", REDIS_PASSWORD="changeme")
    assert process.wait(30) == 1
    assert "gemq-secrets" in (pods.root / f"{NODES}-0.log").read_text()


def test_the_job_forms_the_cluster_and_a_second_run_changes_nothing(pods: Pods) -> None:
    pods.start_all()
    assert all(pods.readiness(i) != 0 for i in range(pods.replicas)), \
        "a node must not be ready before the cluster is formed"
    first = pods.run_job()
    assert first.returncode == 0, first.stdout + first.stderr
    assert pods.formed()
    assert all(pods.readiness(i) == 0 for i in range(pods.replicas))
    for index in range(pods.replicas):
        with pods.client(index) as client:
            assert _config(client, "cluster-enabled") == "yes"
            assert _config(client, "appendonly") == "yes"
            assert _config(client, "maxmemory-policy") == "noeviction"
            assert _config(client, "proto-max-bulk-len") == str(65 * 1024 * 1024)
            assert _config(client, "cluster-announce-hostname") == \
                f"{NODES}-{index}.{pods.service}"
    with redis.Redis(host=pods.ips[0], port=pods.port) as anonymous, \
            pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with _gemq_client(pods.url(0)) as client:
        assert isinstance(client, RedisCluster)
        assert len(client.get_primaries()) == pods.replicas

    before = pods.topology()
    second = pods.run_job()
    assert second.returncode == 0, second.stdout + second.stderr
    assert "nothing to do" in second.stdout
    assert pods.topology() == before


#: Shards whose keys the restart tests write: enough to put keys on every master.
SHARDS = 30


def _formed_with_data(pods: Pods) -> None:
    """Start the pods, form the cluster with the Job, and write one key per shard."""
    pods.start_all()
    formed = pods.run_job()
    assert formed.returncode == 0, formed.stdout + formed.stderr
    with _gemq_client(pods.url(0)) as client:
        for shard in range(SHARDS):
            client.set(f"gemq:{{run/{shard}}}:head", shard)
    for index in range(pods.replicas):
        with pods.client(index) as node:
            assert node.dbsize() > 0, f"no key on {NODES}-{index}"


def _serves_its_data(pods: Pods) -> None:
    assert all(pods.readiness(i) == 0 for i in range(pods.replicas))
    with _gemq_client(pods.url(pods.replicas - 1)) as client:
        assert [client.get(f"gemq:{{run/{shard}}}:head") for shard in range(SHARDS)] == \
            [str(shard).encode() for shard in range(SHARDS)]


def test_nodes_restarted_on_new_addresses_find_each_other(pods: Pods) -> None:
    """Every pod restarts, one after the other, on an address none of them had: the first
    one finds no peer by name (they have no address yet) and starts anyway; the later ones
    find the earlier ones; the cluster is whole again, with its data (AOF)."""
    _formed_with_data(pods)
    pods.stop_all()
    for index in range(pods.replicas):
        pods.start(index, f"{pods.subnet}.{11 + index}", PEER_WAIT_S="1")
    wait_for(lambda: all(pods.answers(i) for i in range(pods.replicas)), timeout_s=30,
             what="the restarted nodes")
    wait_for(pods.formed, timeout_s=30, what="the cluster to be whole again")
    _serves_its_data(pods)


def test_the_job_reintroduces_nodes_that_lost_each_other(pods: Pods) -> None:
    """Every pod restarts on a new address before any of their names resolves, so no node
    can reach another; running the Job again introduces each to the others."""
    _formed_with_data(pods)
    pods.stop_all()
    for index in range(pods.replicas):
        pods.start(index, f"{pods.subnet}.{11 + index}", named=False, PEER_WAIT_S="0")
    wait_for(lambda: all(pods.answers(i) for i in range(pods.replicas)), timeout_s=30,
             what="the restarted nodes")
    pods.name_all()
    assert not pods.formed()
    repair = pods.run_job()
    assert repair.returncode == 0, repair.stdout + repair.stderr
    assert "introducing every node" in repair.stdout
    assert pods.formed()
    _serves_its_data(pods)
