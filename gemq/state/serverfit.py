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
- **Memory.** ``maxmemory`` and the memory used are what gemq.running.sizing fits a run
  into.
- A server that refuses ``CONFIG GET`` (a managed Redis, an ACL user) cannot be checked,
  which a warning says.

gemq's private Redis (``gemq run`` without a URL) is set up by gemq and not checked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis

from gemq.config import RunConfig, proxy_state_bytes
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
    """Bytes of the largest value a run writes: a shard's parameters, a worker's proxy
    state (an Adam proxy's is twice the parameters), or a gradient message at its byte
    limit."""
    size = max(shard.size for shard in plan.shards)
    expected = codec.Expected(config.run_id, "", size, config.wire_dtype,
                              config.max_message_bytes)
    return max(4 * size, proxy_state_bytes(config, size), expected.byte_limit)


@dataclass(frozen=True)
class ServerFacts:
    """What a Redis a user brings says of itself; over a cluster's masters, the figures that
    bind a run: any evicting policy, the largest and smallest value limits, the smallest
    maxmemory (0: none) and the most memory used."""

    policies: frozenset[str]
    largest_value_limit: int
    value_limit: int
    maxmemory: int
    used_memory: int
    masters: int = 1


def read_server(client: redis.Redis) -> ServerFacts | None:
    """The server's facts; None, with a warning, where it refuses ``CONFIG GET`` (a managed
    Redis, an ACL user): gemq then cannot check it."""
    try:
        settings = _settings(client, ("maxmemory-policy", "proto-max-bulk-len", "maxmemory"))
    except redis.ResponseError as e:
        log.warning("cannot read the Redis' settings (CONFIG GET: %s): gemq cannot check "
                    "that its maxmemory-policy is noeviction, which it must be, nor size the "
                    "run to its maxmemory", e)
        return None
    limits = [int(s["proto-max-bulk-len"]) for s in settings]
    maxmemory = [int(s["maxmemory"]) for s in settings if int(s["maxmemory"])]
    return ServerFacts(policies=frozenset(s["maxmemory-policy"] for s in settings),
                       largest_value_limit=max(limits), value_limit=min(limits),
                       maxmemory=min(maxmemory, default=0),
                       used_memory=max(memory_figures(client, "used_memory")),
                       masters=len(settings))


def refuse_eviction(facts: ServerFacts | None) -> None:
    """Refuse a server that may evict gemq's keys (UnsuitableRedis). ``facts``:
    ``read_server``'s (None: not known, nothing to refuse)."""
    evicting = sorted(facts.policies - {"noeviction"}) if facts else []
    if evicting:
        raise UnsuitableRedis(
            f"the Redis evicts keys when full (maxmemory-policy {', '.join(evicting)}), and "
            "a run loses its state when gemq's keys are evicted: set it to noeviction "
            "(CONFIG SET maxmemory-policy noeviction, or `maxmemory-policy noeviction` in "
            "redis.conf)")


def warn_about_value_limit(facts: ServerFacts, config: RunConfig, plan: ShardPlan) -> None:
    """Warn about a server that takes values far larger than the run's largest."""
    largest = largest_value(config, plan)
    bound = max(SAFE_BULK_LEN, largest + BULK_LEN_SLACK)
    allowed = facts.largest_value_limit
    if allowed > bound:
        log.warning("the Redis takes values of up to %d MB (proto-max-bulk-len), and this "
                    "run's largest is %.1f MB: any sender can then make an aggregator hold "
                    "many entries that large at once. Set proto-max-bulk-len to %dmb (as "
                    "k8s/base/config/redis.conf does), or %dmb for runs of this size",
                    allowed // MB, largest / MB, SAFE_BULK_LEN // MB,
                    -(-(largest + BULK_LEN_SLACK) // MB))


def memory_figures(client: redis.Redis, name: str) -> list[int]:
    """``INFO memory``'s ``name`` (used_memory, used_memory_peak) of the server, or of each
    master of a cluster."""
    reply: dict[Any, Any] = client.info("memory", **_every_master(client))
    if name in reply:
        return [int(reply[name])]
    return [int(node[name]) for node in reply.values()]


def _settings(client: redis.Redis, names: tuple[str, ...]) -> list[dict[str, str]]:
    """``names``' values on each master of a cluster, or the one server."""
    kwargs = _every_master(client)
    reply: dict[Any, Any] = client.config_get(*names, **kwargs)
    # A cluster answers per node ({"host:port": {...}}), unless it has one.
    nodes = reply.values() if kwargs and not set(names) & set(reply) else [reply]
    return [{_text(k): _text(v) for k, v in node.items()} for node in nodes]


def _every_master(client: redis.Redis) -> dict[str, Any]:
    """The keyword that sends a command to every master of a cluster (none for one server)."""
    return {"target_nodes": redis.RedisCluster.PRIMARIES} if is_cluster(client) else {}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
