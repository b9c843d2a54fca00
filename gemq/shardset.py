"""A worker's side of every shard of a run: read each shard's newest parameters, publish one
slice of each gradient to each shard's stream.

On one Redis, a step's reads go in one pipeline and its publications in one MULTI (one
round trip each, whatever the number of shards). On a Redis Cluster a MULTI must stay in
one slot: each shard publishes in a transaction of its own, all shards' at once from a
thread pool, and reads go in one cluster pipeline (one round trip per node).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from redis.cluster import RedisCluster

from gemq.shards import ShardPlan
from gemq.store import RunStore, StepView


class RunShards:
    """The shards of ``store``'s run, for a worker."""

    def __init__(self, store: RunStore) -> None:
        self.stores = store.shards()
        self.plan: ShardPlan = store.plan()
        self.cluster = isinstance(store.client, RedisCluster)
        self._r: Any = store.client
        self._pool = (ThreadPoolExecutor(len(self.stores), thread_name_prefix="gemq-shard")
                      if self.cluster and len(self.stores) > 1 else None)

    @property
    def count(self) -> int:
        return len(self.stores)

    def views(self) -> list[StepView]:
        """Every shard's version and stream length (and the run's state, in shard 0's)."""
        pipe = self._r.pipeline(transaction=False)
        for store in self.stores:
            store.queue_view(pipe)
        replies = pipe.execute()
        views, at = [], 0
        for store in self.stores:
            views.append(store.view_of(replies[at:at + store.view_length]))
            at += store.view_length
        return views

    def snapshots(self, versions: dict[int, int]) -> dict[int, tuple[int, np.ndarray]]:
        """The parameters of each shard at the version given (the newest instead, where a
        newer one replaced it meanwhile): shard -> (version, parameters)."""
        pipe = self._r.pipeline(transaction=False)
        for shard, version in versions.items():
            pipe.get(self.stores[shard].keys.params(version))
        found = {}
        for (shard, version), raw in zip(versions.items(), pipe.execute(), strict=True):
            found[shard] = ((version, np.frombuffer(raw, "<f4")) if raw is not None
                            else self.stores[shard].latest())  # dropped: read the head again
        return found

    def publish(self, worker_id: str, messages: dict[int, bytes]) -> list[StepView]:
        """Publish ``messages[k]`` to shard k (the shards with room: not necessarily all);
        return every shard's view for the next step."""
        if self._pool is None:  # one server: one MULTI for every shard
            pipe = self._r.pipeline(transaction=True)
            for store in self.stores:
                if store.shard in messages:
                    store.queue_publish_and_view(pipe, worker_id, messages[store.shard])
                else:
                    store.queue_view(pipe)
            replies = pipe.execute(raise_on_error=False)
            views, at = [], 0
            for store in self.stores:
                if store.shard in messages:
                    views.append(store.published_view(replies[at:at + store.publish_length]))
                    at += store.publish_length
                else:
                    views.append(store.view_of(replies[at:at + store.view_length]))
                    at += store.view_length
            return views
        futures = {k: self._pool.submit(self.stores[k].publish_and_view, worker_id, message)
                   for k, message in messages.items()}
        return [futures[k].result() if k in futures else store.step_view()
                for k, store in enumerate(self.stores)]

    def heartbeat(self, worker_id: str) -> None:
        """Tell every shard's aggregator this worker is alive (it waits without publishing)."""
        for store in self.stores:
            store.heartbeat(worker_id)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
