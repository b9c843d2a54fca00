"""Outages a production Redis has, met by ``gemq run`` on a Redis (or Redis Cluster) the user
names: it waits them out as its aggregator and workers do, for as long as the run would
wait for workers that cannot publish (stall_timeout_s), then ends with one line
(docs/reliability.md). Real redis-server processes with AOF, killed and restarted; gemq
run as a user runs it."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from gemq.running.cluster import EmbeddedCluster
from gemq.running.embedded import EmbeddedRedis
from gemq.state.connection import connect
from gemq.state.store import RunState, RunStore
from tests.helpers import GemqProcess, wait_for
from tests.podman import balanced

SMALL = ("--model", "logreg", "--dataset", "digits", "--workers", "2", "--no-progress")


@pytest.fixture
def durable_redis() -> Iterator[EmbeddedRedis]:
    """A Redis whose every write is on disk before it answers (AOF, fsync always): a kill
    loses nothing that was acknowledged."""
    with tempfile.TemporaryDirectory(prefix="gemq-aof-") as directory, EmbeddedRedis(
            appendonly=True, directory=directory,
            extra_args=("--appendfsync", "always")) as server:
        yield server


def _training(server: EmbeddedRedis, run_id: str, out: Path, applied: int,
              *flags: str) -> GemqProcess:
    """``gemq run`` of ``run_id`` on ``server``, once it has applied ``applied`` updates."""
    store = RunStore(redis.Redis.from_url(server.url), run_id)
    process = GemqProcess("run", *SMALL, *flags, "--run", run_id, "--redis-url", server.url,
                          "--out", str(out))
    try:
        wait_for(lambda: store.exists() and store.counters().get("applied", 0) >= applied,
                 timeout_s=300, what=f"{applied} updates")
    except BaseException:
        process.stop()
        raise
    return process


def _finishes_after(process: GemqProcess, outage: Callable[[], None]) -> str:
    """Bring ``outage`` on the running ``process``, which must then finish its run (exit 0,
    no traceback); its output."""
    try:
        outage()
        code = process.wait(timeout=400)
        output = process.output()
    finally:
        process.stop()
    assert code == 0, output[-3000:]
    assert "Traceback" not in output
    return output


def _restart(server: EmbeddedRedis, after_s: float) -> None:
    server.kill()  # SIGKILL: an outage, not a shutdown
    time.sleep(after_s)
    server.start()


def _restart_node(cluster: EmbeddedCluster, index: int, after_s: float) -> None:
    cluster.kill_node(index)
    time.sleep(after_s)
    cluster.start_node(index, timeout_s=60)


@pytest.mark.slow
def test_gemq_run_waits_out_a_redis_restart_and_applies_every_gradient_once(
        durable_redis: EmbeddedRedis, tmp_path: Path) -> None:
    process = _training(durable_redis, "outage", tmp_path / "o", 1000, "--steps", "4000")
    output = _finishes_after(process, lambda: _restart(durable_redis, after_s=3))
    assert "Redis unreachable" in output  # said, and waited out
    client = redis.Redis.from_url(durable_redis.url)
    store = RunStore(client, "outage")
    counters = store.counters()
    assert store.state() == RunState.FINISHED
    assert counters["applied"] == 4000 == store.head().version
    assert balanced(counters), counters  # each gradient applied, rejected or unused: once
    assert (tmp_path / "o" / "model.pt").is_file()


@pytest.mark.slow
def test_gemq_run_gives_up_on_a_redis_gone_for_longer_than_the_stall_timeout(
        durable_redis: EmbeddedRedis, tmp_path: Path) -> None:
    process = _training(durable_redis, "gone", tmp_path / "g", 500, "--steps", "200000",
                        "--stall-timeout-s", "5")
    try:
        durable_redis.kill()
        started = time.monotonic()
        code = process.wait(timeout=120)
        waited = time.monotonic() - started
        output = process.output()
    finally:
        process.stop()
    assert code == 1, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("gemq: error: run gone: Redis unreachable for "), last
    assert "longer than the run's stall_timeout_s (5 s)" in last
    assert "Traceback" not in output
    assert 5 <= waited < 60, waited


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cluster_node_that_crashes_and_comes_back_is_waited_out_on_every_shard(
        tmp_path: Path) -> None:
    """One master of three SIGKILLed and started again (its AOF kept): CLUSTERDOWN is an
    outage to the aggregators, the workers and gemq run alike, and every shard finishes
    (before, the shard on that node crashed on ClusterDownError and stayed behind)."""
    with EmbeddedCluster(3, appendonly=True) as cluster:
        client = connect(cluster.url)
        store = RunStore(client, "cdown")
        process = GemqProcess("run", "--model", "mlp", "--dataset", "digits", "--workers", "2",
                              "--no-progress", "--steps", "1500", "--shards", "3", "--run",
                              "cdown", "--redis-url", cluster.url, "--out", str(tmp_path))
        try:
            wait_for(lambda: store.exists() and all(
                s.head().version >= 300 for s in store.shards()), timeout_s=300,
                what="300 updates on every shard")
        except BaseException:
            process.stop()
            raise
        _finishes_after(process, lambda: _restart_node(cluster, 2, after_s=2))
        assert [s.head().version for s in store.shards()] == [1500, 1500, 1500]
        assert store.state() == RunState.FINISHED
