"""A Redis a user brings is checked before a run is written to it (gemq.state.serverfit):
one that may evict gemq's keys is refused with the setting to change, one that takes values
far larger than the run's gets a warning, one whose settings cannot be read gets a warning.
Real redis-server processes (and a real cluster), the CLI in-process and the API as a
service."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from gemq.running.cluster import EmbeddedCluster
from gemq.running.embedded import EmbeddedRedis
from tests.test_api import TOKEN, start_api
from tests.test_cli import assert_one_error, in_process

CREATE = ("create", "--model", "logreg", "--dataset", "digits", "--steps", "10", "--run", "r")


@pytest.fixture
def safe_redis(redis_server: EmbeddedRedis, redis_client: redis.Redis) -> EmbeddedRedis:
    """As gemq's embedded Redis and k8s/base/config/redis.conf are set."""
    assert redis_client.config_get("proto-max-bulk-len") == {
        "proto-max-bulk-len": str(65 * 1024 * 1024)}
    return redis_server


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "allkeys-random",
                                    "volatile-ttl"])
def test_a_redis_that_evicts_keys_is_refused_naming_the_setting(
        policy: str, safe_redis: EmbeddedRedis, redis_client: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    redis_client.config_set("maxmemory-policy", policy)
    result = in_process(capsys, *CREATE, "--redis-url", safe_redis.url)
    line = assert_one_error(result, 1)
    assert policy in line and "CONFIG SET maxmemory-policy noeviction" in line
    assert redis_client.dbsize() == 0  # nothing written


def test_gemq_run_on_an_evicting_redis_is_refused_before_anything_is_written(
        safe_redis: EmbeddedRedis, redis_client: redis.Redis, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    result = in_process(capsys, "run", "--model", "logreg", "--dataset", "digits",
                        "--steps", "10", "--redis-url", safe_redis.url, "--out",
                        str(tmp_path / "out"), "--no-progress")
    assert "noeviction" in assert_one_error(result, 1)
    assert redis_client.dbsize() == 0 and not (tmp_path / "out").exists()


def test_a_suitable_redis_is_used_without_a_word(
        safe_redis: EmbeddedRedis, redis_client: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(capsys, *CREATE, "--redis-url", safe_redis.url)
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "r", "")
    assert redis_client.exists("gemq:{r}:config")


def test_a_redis_taking_huge_values_is_used_with_a_warning_naming_the_setting(
        redis_server: EmbeddedRedis, redis_client: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Redis' default proto-max-bulk-len, 512 MB (gemq's embedded Redis sets 65 MB): a
    sender could make an aggregator hold many entries of that size."""
    redis_client.config_set("proto-max-bulk-len", 512 * 1024 * 1024)
    result = in_process(capsys, *CREATE, "--redis-url", redis_server.url)
    assert result.returncode == 0 and result.stdout.strip() == "r"
    (warning,) = result.stderr.splitlines()
    assert "up to 512 MB (proto-max-bulk-len)" in warning and "65mb" in warning


def test_a_redis_whose_settings_cannot_be_read_is_used_with_a_warning(
        safe_redis: EmbeddedRedis, redis_client: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An ACL user without CONFIG, as managed Redis services give."""
    redis_client.acl_setuser("app", enabled=True, passwords=["+pw"], keys=["*"],
                             channels=["*"], commands=["+@all", "-config"])
    url = safe_redis.url.replace("redis://", "redis://app:pw@")
    result = in_process(capsys, *CREATE, "--redis-url", url)
    assert result.returncode == 0 and result.stdout.strip() == "r"
    (warning,) = result.stderr.splitlines()
    assert "cannot read the Redis' settings" in warning and "noeviction" in warning


def test_a_cluster_with_one_evicting_master_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    with EmbeddedCluster(3) as cluster:
        client = redis.RedisCluster.from_url(cluster.url)
        try:
            client.config_set("proto-max-bulk-len", 65 * 1024 * 1024,
                              target_nodes=redis.RedisCluster.PRIMARIES)
            last = client.get_primaries()[-1]
            client.config_set("maxmemory-policy", "allkeys-lfu", target_nodes=last)
            result = in_process(capsys, *CREATE, "--redis-url", cluster.url)
            assert "allkeys-lfu" in assert_one_error(result, 1)
            assert client.dbsize(target_nodes=redis.RedisCluster.PRIMARIES) == 0
        finally:
            client.close()


def test_the_api_answers_503_naming_the_setting(
        safe_redis: EmbeddedRedis, redis_client: redis.Redis) -> None:
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    api = start_api(safe_redis.url, GEMQ_API_TOKEN=TOKEN)
    try:
        with api.client(TOKEN) as c:
            reply = c.post("/api/runs", json={"model": "logreg", "dataset": "digits",
                                              "steps": 10, "run_id": "r"})
    finally:
        api.process.stop()
    assert reply.status_code == 503, reply.text
    assert "maxmemory-policy allkeys-lru" in reply.json()["detail"]
    assert not redis_client.exists("gemq:{r}:config")
