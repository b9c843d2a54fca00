"""Where a new run's shards go on a Redis Cluster: hash tags that spread them over the masters.

Redis Cluster keeps a key in slot CRC16(hash tag) mod 16384 and each master serves some of
the slots, so the shards' default tags (gemq/state/keys.py: ``<run>``, ``<run>/<k>``) leave it to
the run id which masters they share. When a run is created on a cluster, shard 0 keeps
``<run>`` (the run-wide keys live in its slot) and the others go round-robin over the
masters from shard 0's: shard k takes the first of ``<run>/<k>``, ``<run>/<k>.1``,
``<run>/<k>.2``, ... whose slot the wanted master serves. S shards on M masters thus put
S // M or S // M + 1 on each. The tags that differ from the defaults are written with the
run's configuration (``RunKeys.shard_tags``), and ``RunStore`` opens shard k through them.
The slot map is read once, at creation: a later resharding moves slots, never keys' names,
so every shard is still found by its tag, wherever its slot went.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from gemq.state.keys import RunKeys, shard_tag

#: Candidate tags tried for a shard before it keeps its default one. A master serving a
#: third of the slots is hit within 3 tries on average; this bound leaves room for a master
#: that serves a handful of slots, at the price of a CRC16 per try, once per run.
ATTEMPTS = 100_000


def placed_tags(client: redis.Redis, run_id: str, count: int) -> dict[int, str]:
    """The hash tags of the shards of a new run that do not keep their default one, by shard
    index: none on a plain Redis or for a run of one shard (its keys stay as they were)."""
    if count < 2 or not isinstance(client, RedisCluster):
        return {}
    return spread(run_id, count, slot_owners(client))


def slot_owners(cluster: RedisCluster) -> list[str | None]:
    """The master serving each slot (``host:port``), from CLUSTER SLOTS; None: unserved."""
    reply: Any = cluster.cluster_slots()
    owners: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    for (first, last), nodes in reply.items():
        host, port = nodes["primary"][:2]
        owners[first:last + 1] = [f"{host}:{port}"] * (last + 1 - first)
    return owners


def spread(run_id: str, count: int, owners: Sequence[str | None]) -> dict[int, str]:
    """``placed_tags`` for a slot map ``owners`` (slot -> master): shard k on the k-th master
    after shard 0's, in name order; a shard no candidate puts there keeps its default."""
    masters = sorted({owner for owner in owners if owner is not None})
    first = owners[_slot(run_id, 0, run_id)]
    if first is None:  # shard 0's slot unserved: nothing to go round from
        return {}
    start = masters.index(first)
    tags = {}
    for k in range(1, count):
        wanted = masters[(start + k) % len(masters)]
        tag = next((shard_tag(run_id, k, n) for n in range(ATTEMPTS)
                    if owners[_slot(run_id, k, shard_tag(run_id, k, n))] == wanted), None)
        if tag is not None and tag != shard_tag(run_id, k):
            tags[k] = tag
    return tags


def _slot(run_id: str, shard: int, tag: str) -> int:
    """The slot of the shard's keys under ``tag`` (hashed as Redis hashes them)."""
    return key_slot(RunKeys(run_id, shard, tag).prefix.encode())
