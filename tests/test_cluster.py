"""gemq on a real Redis Cluster: three redis-server masters started by the test
(gemq/running/cluster.py: EmbeddedCluster), sharded runs on it, and their exactness."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster

from gemq.errors import RunBusy
from gemq.running.cluster import EmbeddedCluster
from gemq.running.embedded import EmbeddedRedis
from gemq.running.local import train
from gemq.state.connection import connect, is_cluster
from gemq.state.keys import run_key_pattern
from gemq.state.retention import RetentionPolicy, apply_retention, delete_run, holds_training_state
from gemq.state.store import RunState, RunStore
from tests.helpers import GemqProcess, small_run, wait_for
from tests.test_api import start_api
from tests.test_shards import lockstep


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(3) as started:
        yield started


@pytest.fixture
def cluster_client(cluster: EmbeddedCluster) -> Iterator[redis.Redis]:
    client = connect(cluster.url)
    yield client
    client.flushall(target_nodes="primaries")  # type: ignore[call-arg]
    client.close()


def test_any_nodes_url_gives_a_cluster_client(cluster: EmbeddedCluster,
                                              redis_client: redis.Redis) -> None:
    for url in cluster.urls:
        client = connect(url)
        assert isinstance(client, RedisCluster) and is_cluster(url)
        client.close()
    assert not isinstance(redis_client, RedisCluster) and not is_cluster(redis_client)


def masters_holding(store: RunStore) -> list[str]:
    """The master each shard's head is stored on, asked of the masters themselves (as a
    process that opens the run finds the shards: by the run's stored tags)."""
    cluster: RedisCluster = store.client  # type: ignore[assignment]
    holder = {key.decode(): node.name for node in cluster.get_primaries()
              for key in cluster.get_redis_connection(node).scan_iter(
                  match=run_key_pattern(store.run_id))}
    found = []
    for shard in store.shards():
        assert RunStore(cluster, store.run_id, shard.shard).keys == shard.keys
        found.append(holder[shard.keys.head])
    return found


def test_shards_spread_over_the_masters_whatever_the_run_id(
        cluster_client: redis.Redis) -> None:
    for i in range(20):
        store = small_run(cluster_client, f"run-20261203-1942{i:02d}-{i * 7919:05x}",
                          shards=3)
        assert len(set(masters_holding(store))) == 3, store.run_id
    six = small_run(cluster_client, "six", shards=6)
    assert sorted(Counter(masters_holding(six)).values()) == [2, 2, 2]
    one = small_run(cluster_client, "one")
    assert not cluster_client.exists(one.keys.shard_tags)
    assert {k.decode() for k in cluster_client.scan_iter(match=run_key_pattern("one"))} == {
        one.keys.config, one.keys.layout, one.keys.status, one.keys.head, one.keys.params(0),
        one.keys.versions, one.keys.gradients}


def test_an_ended_placed_run_is_freed_and_deleted_on_every_master(
        cluster_client: redis.Redis) -> None:
    lockstep(cluster_client, "placed", 10, algo="gem", shards=3)
    store = RunStore(cluster_client, "placed")
    assert cluster_client.hlen(store.keys.shard_tags) > 0  # else this id tests nothing new
    for shard in store.shards():
        cluster_client.hset(shard.keys.head, "state", RunState.FINISHED)
    assert store.conclude() == RunState.FINISHED
    shards = store.shards()
    assert any(holds_training_state(cluster_client, [s.keys for s in shards]))
    swept = apply_retention(cluster_client, RetentionPolicy(keep_runs=0))
    assert swept.released == ["placed"] and swept.deleted == []
    assert not any(holds_training_state(cluster_client, [s.keys for s in shards]))
    cluster_client.delete(store.keys.lease)  # shard 0's aggregator left; the others lead
    with pytest.raises(RunBusy, match="held by an aggregator"):
        delete_run(cluster_client, "placed")
    for shard in shards[1:]:
        cluster_client.delete(shard.keys.lease)
    assert delete_run(cluster_client, "placed").keys > 3 * 5
    cluster: RedisCluster = cluster_client  # type: ignore[assignment]
    for node in cluster.get_primaries():
        assert not list(cluster.get_redis_connection(node).scan_iter(match="gemq:*placed*"))


def test_sharded_runs_on_a_cluster_end_as_the_unsharded_run_on_one_redis(
        cluster_client: redis.Redis, redis_client: redis.Redis) -> None:
    whole = lockstep(redis_client, "plain", 30, algo="downpour")
    for count in (1, 3):
        on_cluster = lockstep(cluster_client, f"clustered-{count}", 30, algo="downpour",
                              shards=count)
        np.testing.assert_array_equal(on_cluster, whole)
    gem_whole = lockstep(redis_client, "plain-gem", 30, algo="gem")
    gem_cluster = lockstep(cluster_client, "clustered-gem", 30, algo="gem", shards=3)
    np.testing.assert_allclose(gem_cluster, gem_whole, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_gemq_run_on_a_private_cluster_trains_every_shard(tmp_path: object) -> None:
    summary = train(model="mlp", dataset="digits", workers=2, steps=300, shards=3,
                    local_cluster=3, progress=False, out_dir=str(tmp_path))
    assert summary.state == "finished" and summary.updates_applied == 300
    assert [s["applied"] for s in summary.shards] == [300, 300, 300]
    assert summary.redis == "embedded cluster of 3 masters"
    assert summary.test_accuracy is not None and summary.test_accuracy > 0.85


@pytest.mark.slow
def test_the_services_run_a_sharded_run_on_a_cluster_with_rq_beside_it(
        cluster: EmbeddedCluster, redis_server: EmbeddedRedis, redis_client: redis.Redis,
        cluster_client: redis.Redis) -> None:
    """rq cannot use a Redis Cluster: the queue lives on a plain Redis (GEMQ_QUEUE_URL), the
    runs on the cluster. The API enqueues one job per shard there, aggregator services take
    them and lead each shard on the cluster, a worker service trains, the run finishes."""
    env = {**os.environ, "GEMQ_QUEUE_URL": redis_server.url}
    api = start_api(cluster.url, **env)
    aggregators = [GemqProcess("aggregator", "--serve", "--redis-url", cluster.url,
                               "--lease-ms", "1000", env=env) for _ in range(2)]
    worker = GemqProcess("worker", "--follow", "--redis-url", cluster.url, env=env)
    try:
        with api.client(None) as c:
            created = c.post("/api/runs", json={
                "run_id": "beside", "model": "logreg", "dataset": "digits", "steps": 200,
                "batch_size": 16, "shards": 3})
            assert created.status_code == 201, created.text
            jobs = {k.decode() for k in redis_client.scan_iter("rq:job:*")}
            assert jobs == {"rq:job:gemq-aggregate-beside",
                            "rq:job:gemq-aggregate-beside-shard-1",
                            "rq:job:gemq-aggregate-beside-shard-2"}

            def finished() -> bool:
                return bool(c.get("/api/runs/beside").json()["state"] == "finished")

            wait_for(finished, timeout_s=120, what="the run to finish: " + "\n".join(
                p.output()[-2000:] for p in (*aggregators, worker)))
            view = c.get("/api/runs/beside").json()
            assert [s["applied"] for s in view["shards"]] == [200, 200, 200]
            assert view["job"]["id"] == "gemq-aggregate-beside"
            assert view["job"]["state"] in ("started", "finished")
        assert not [k for k in redis_client.scan_iter("gemq:*")]  # runs: cluster
    finally:
        for process in (*aggregators, worker, api.process):
            process.stop()
