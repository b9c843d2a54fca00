"""Whether a Redis a user brings suits a run, checked before the run is written to it.

- **Eviction.** gemq's keys must never be evicted: a lost lease, staged moment, gradient or
  parameter version breaks exactly-once and GEM's exactness. A server with any
  ``maxmemory-policy`` but ``noeviction`` is refused, with the setting to change (it then
  refuses writes when full, which gemq reports and waits out).
- **Value size.** ``proto-max-bulk-len`` bounds one stream entry, and an aggregator's read
  takes many entries at once; a Redis that accepts values far larger than a run's largest
  lets any sender make the aggregator hold that many oversized entries (measured: twenty
  50 MB entries took it from 228 to 1,368 MB). Such a server is used, with a warning that
  names the setting.
- A server that refuses ``CONFIG GET`` (a managed Redis, an ACL user) cannot be checked,
  which a warning says.

gemq's private Redis (``gemq run`` without a URL) is set up by gemq and not checked.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from gemq.config import RunConfig
from gemq.errors import GemqError
from gemq.shards import ShardPlan
from gemq.state.connection import is_cluster
from gemq.wire import codec

log = logging.getLogger(__name__)

#: The value size limit beyond which a server is worth a warning: the deployment's own
#: setting (k8s/base/config/redis.conf), or the run's largest value if larger.
SAFE_BULK_LEN = 65 * 1024 * 1024
#: Room beyond a run's largest value (a gradient's header, rounding).
BULK_LEN_SLACK = 64 * 1024
MB = 1024 * 1024


class UnsuitableRedis(GemqError):
    """The Redis named cannot hold a run safely; the message says which setting to change."""


def largest_value(config: RunConfig, plan: ShardPlan) -> int:
    """Bytes of the largest value a run writes: a shard's parameters, or a gradient
    message at its byte limit."""
    size = max(shard.size for shard in plan.shards)
    expected = codec.Expected(config.run_id, "", size, config.wire_dtype,
                              config.max_message_bytes)
    return max(4 * size, expected.byte_limit)


def check_server(client: redis.Redis, config: RunConfig, plan: ShardPlan) -> None:
    """Refuse a server that may evict gemq's keys (UnsuitableRedis); warn about one that
    takes values far larger than the run's, or whose settings cannot be read."""
    try:
        settings = _settings(client, ("maxmemory-policy", "proto-max-bulk-len"))
    except redis.ResponseError as e:
        log.warning("cannot read the Redis' settings (CONFIG GET: %s): gemq cannot check "
                    "that its maxmemory-policy is noeviction, which it must be", e)
        return
    evicting = sorted({s["maxmemory-policy"] for s in settings} - {"noeviction"})
    if evicting:
        raise UnsuitableRedis(
            f"the Redis evicts keys when full (maxmemory-policy {', '.join(evicting)}), and "
            "a run loses its state when gemq's keys are evicted: set it to noeviction "
            "(CONFIG SET maxmemory-policy noeviction, or `maxmemory-policy noeviction` in "
            "redis.conf)")
    largest = largest_value(config, plan)
    bound = max(SAFE_BULK_LEN, largest + BULK_LEN_SLACK)
    allowed = max(int(s["proto-max-bulk-len"]) for s in settings)
    if allowed > bound:
        log.warning("the Redis takes values of up to %d MB (proto-max-bulk-len), and this "
                    "run's largest is %.1f MB: any sender can then make an aggregator hold "
                    "many entries that large at once. Set proto-max-bulk-len to %dmb (as "
                    "k8s/base/config/redis.conf does), or %dmb for runs of this size",
                    allowed // MB, largest / MB, SAFE_BULK_LEN // MB,
                    -(-(largest + BULK_LEN_SLACK) // MB))


def _settings(client: redis.Redis, names: tuple[str, ...]) -> list[dict[str, str]]:
    """``names``' values on each master of a cluster, or the one server."""
    kwargs: dict[str, Any] = {}
    if is_cluster(client):
        kwargs["target_nodes"] = redis.RedisCluster.PRIMARIES
    reply: dict[Any, Any] = client.config_get(*names, **kwargs)
    # A cluster answers per node ({"host:port": {...}}), unless it has one.
    nodes = reply.values() if kwargs and not set(names) & set(reply) else [reply]
    return [{_text(k): _text(v) for k, v in node.items()} for node in nodes]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
