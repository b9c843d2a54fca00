"""A worker's side of every shard of a run: read each shard's newest parameters, publish one
slice of each gradient to each shard's stream.

On one Redis, a step's reads go in one pipeline and its publications in one MULTI (one
round trip each, whatever the number of shards). On a Redis Cluster a MULTI must stay in
one slot: each shard publishes in a transaction of its own, all shards' at once from a
thread pool, and reads go in one cluster pipeline (one round trip per node).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from redis.cluster import RedisCluster

from gemq.shards import ShardPlan
from gemq.state.store import RunStore, StepView
from gemq.wire.codec import Message

#: shard -> (version, parameters): what a read of the shards' parameters gives.
Snapshots = dict[int, tuple[int, np.ndarray]]


class SharedReads:
    """The newest parameters any worker of one process read, per shard of one run.

    Every worker reads the whole model each time it changes; workers that share a process
    share those reads: a worker asking for a version that another has read already (or a
    newer one) gets that copy instead of a read of its own. The copies are read-only (each
    worker loads them into its own model), and one read happens at a time, so workers that
    want the same new version read it once between them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest: Snapshots = {}

    def get(self, versions: dict[int, int],
            read: Callable[[dict[int, int]], Snapshots]) -> Snapshots:
        """Shard -> (version, parameters) at ``versions`` or newer; ``read`` fetches what
        no worker of the process has."""
        with self._lock:
            found = {k: self._newest[k] for k, version in versions.items()
                     if k in self._newest and self._newest[k][0] >= version}
            missing = {k: version for k, version in versions.items() if k not in found}
            if missing:
                fresh = read(missing)
                for k, (version, params) in fresh.items():
                    if k not in self._newest or version > self._newest[k][0]:
                        self._newest[k] = (version, params)
                found.update(fresh)
        return found


class RunShards:
    """The shards of ``store``'s run, for a worker (``shared``: the reads it shares with the
    other workers of its process)."""

    def __init__(self, store: RunStore, shared: SharedReads | None = None) -> None:
        self.shared = shared
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

    def snapshots(self, versions: dict[int, int]) -> Snapshots:
        """The parameters of each shard at the version given (a newer one instead, where
        the process has it already or a newer one replaced it meanwhile): shard ->
        (version, parameters)."""
        if self.shared is None:
            return self._read(versions)
        return self.shared.get(versions, self._read)

    def _read(self, versions: dict[int, int]) -> Snapshots:
        pipe = self._r.pipeline(transaction=False)
        for shard, version in versions.items():
            self.stores[shard].queue_snapshot(pipe, version)
        found = {}
        for (shard, version), raw in zip(versions.items(), pipe.execute(), strict=True):
            found[shard] = ((version, np.frombuffer(raw, "<f4")) if raw is not None
                            else self.stores[shard].latest())  # dropped: read the head again
        return found

    def publish(self, worker_id: str, messages: Mapping[int, Message]) -> list[StepView]:
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
