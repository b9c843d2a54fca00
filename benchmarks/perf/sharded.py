"""One measurement of a sharded run's transport: S real aggregators, synthetic gradients.

The run is real (``RunStore.create`` with ``shards=S``, GEM on) and so are its S aggregator
processes (``gemq.aggregation.aggregator.aggregator_main``, one per shard, as
``gemq run --shards S`` starts them). Producer processes stand in for workers: through a
worker's own transport (``gemq.training.shardset.RunShards``: every shard's version and
stream length in one round trip, one slice of the gradient to each shard's stream) they
publish a fixed gradient as fast as backpressure lets them, computed on whatever version
each shard's head names. No model, no parameter reads: what is measured is what the
shards' Redis servers and aggregators can move.

The servers are one plain redis-server (``masters=0``) or a Redis Cluster of ``masters``
redis-server processes (``gemq.running.cluster.EmbeddedCluster``); the run's id is chosen so its
shards' hash tags spread evenly over the masters.

Besides the rate, each process's CPU seconds per update (``psutil``, user + system) and
each server's bytes in and out per update (Redis' own ``total_net_*_bytes``), from which
docs/performance.md projects throughput on machines with a core per process.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import psutil
import redis
from redis.crc import key_slot

from benchmarks.perf.common import MB, start, stop, wait_for
from benchmarks.perf.messages import Messages
from gemq.aggregation.aggregator import aggregator_main
from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.process import graceful_shutdown
from gemq.running.cluster import SLOTS, EmbeddedCluster
from gemq.running.embedded import EmbeddedRedis
from gemq.state.connection import connect
from gemq.state.keys import RunKeys
from gemq.state.store import RunStore
from gemq.training.shardset import RunShards

#: Bytes of gradients allowed in flight over all shards' streams (as in transport.py):
#: bounds max_pending, and so Redis' memory, for the large models.
PENDING_BYTES = 256 * MB
LEASE_MS = 5000
#: jemalloc's own defaults (an empty MALLOC_CONF overrides gemq's KEEP_FREED_PAGES): every
#: freed multi-megabyte value goes back to the kernel at once, and the next one is faulted
#: in page by page. What gemq's private Redis did before it kept freed pages.
RELEASE_PAGES = ""
#: A window lasts until this many updates were applied, up to EXTEND times its length.
MIN_UPDATES, EXTEND = 4, 5


@dataclass(frozen=True)
class Sizing:
    """A run's settings for ``size`` parameters in ``shards`` shards, fed by ``producers``."""

    size: int
    shards: int
    producers: int
    max_pending: int
    read_batch: int
    kept: int

    @classmethod
    def of(cls, size: int, shards: int, producers: int) -> Sizing:
        # At least 2: a commit trims its stream up to the entry it applied last, not past
        # it, so one entry always stays (with max_pending 1, nothing would be published
        # after the first update).
        max_pending = int(np.clip(PENDING_BYTES // (4 * size), 2, 64))
        read_batch = max(1, min(32, max_pending // 2))
        # A producer reads the heads, then publishes behind at most max_pending - 2 entries
        # not applied yet (the stream's length counts the one applied last) and one from
        # each other producer that saw room at the same moment: that many updates stale at
        # most, a version every read_batch; one more version for the margin.
        stale = max(max_pending + producers - 3, 0)
        kept = math.ceil(stale / read_batch) + 2
        return cls(size, shards, producers, max_pending, read_batch, kept)

    @property
    def shard_bytes(self) -> int:
        return 4 * math.ceil(self.size / self.shards)

    def config(self, run_id: str) -> RunConfig:
        """GEM, publishing once per read batch (as transport.py's aggregator does), with
        room for ``kept`` snapshots so no gradient is rejected for its age."""
        return RunConfig(run_id=run_id, budget_updates=10**9, shards=self.shards,
                         max_pending=self.max_pending, read_batch=self.read_batch,
                         publish_every=self.read_batch, history=self.kept,
                         snapshot_budget_mb=self.kept * math.ceil(self.shard_bytes / MB))


def synthetic_layout(size: int) -> ParamLayout:
    """Ten equal tensors (so shards may be cut at tensor boundaries, as with real models)."""
    return ParamLayout.from_shapes([(f"layer{i}", (size // 10 + (i < size % 10),))
                                    for i in range(10)])


@contextlib.contextmanager
def servers(masters: int,
            release_pages: bool = False) -> Iterator[tuple[str, list[EmbeddedRedis]]]:
    """(URL, server processes): one plain Redis for ``masters=0``, else a Redis Cluster;
    with ``release_pages``, their allocator hands what it frees back to the kernel at once
    (RELEASE_PAGES) instead of keeping it (gemq.running.embedded.KEEP_FREED_PAGES)."""
    with contextlib.ExitStack() as stack:
        with _environment(MALLOC_CONF=RELEASE_PAGES if release_pages else None):
            if masters == 0:
                nodes = [stack.enter_context(EmbeddedRedis())]
            else:
                nodes = stack.enter_context(EmbeddedCluster(masters)).nodes
        yield nodes[0].url, nodes


@contextlib.contextmanager
def _environment(**variables: str | None) -> Iterator[None]:
    """Set (or, for None, leave unset) environment variables while processes start."""
    saved = {name: os.environ.get(name) for name in variables}
    for name, value in variables.items():
        if value is not None:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def spread_run_id(prefix: str, shards: int, masters: int) -> str:
    """A run id whose shards fall as evenly as they can over the masters of an
    EmbeddedCluster (it gives master i the i-th equal run of slots). gemq itself does not
    choose: with S shards on M masters, some run ids put several shards on one master."""
    if masters <= 1:
        return prefix
    for attempt in range(10_000):
        run_id = f"{prefix}-{attempt}"
        owners = [key_slot(RunKeys(run_id, k).head.encode()) * masters // SLOTS
                  for k in range(shards)]
        counts = [owners.count(m) for m in range(masters)]
        if max(counts) - min(counts) <= 1:
            return run_id
    raise RuntimeError(f"no run id spreads {shards} shards over {masters} masters")


def produce(url: str, run_id: str, worker_id: str, seed: int, max_pending: int) -> None:
    """Publish one slice of a fixed gradient to every shard, as fast as backpressure lets."""
    shutdown = graceful_shutdown()
    client = connect(url, retries=0)
    shards = RunShards(RunStore(client, run_id))
    rng = np.random.default_rng(seed)
    messages = [Messages(run_id, worker_id, shards.plan.layout_id_of(shard.index),
                         rng.standard_normal(shard.size, dtype=np.float32) * 1e-3)
                for shard in shards.plan.shards]
    shards.heartbeat(worker_id)  # registers it, as a worker's first step
    views = shards.views()
    while not shutdown.is_set():
        if any(view.pending >= max_pending for view in views):
            shutdown.wait(0.001)
            views = shards.views()
            continue
        views = shards.publish(worker_id, {k: m.at(view.version) for k, (m, view)
                                           in enumerate(zip(messages, views, strict=True))})
    shards.close()
    client.close()


@dataclass
class Rig:
    """The processes of one measurement, by role."""

    stores: list[RunStore]
    nodes: list[EmbeddedRedis]
    aggregators: list[BaseProcess]
    producers: list[BaseProcess]

    def updates(self) -> int:
        """Gradients applied by every shard (the run's count: its slowest shard's)."""
        return min(store.head().updates for store in self.stores)

    def leading(self) -> bool:
        """Whether every shard has a leader (its first read follows at once)."""
        self.started(0)
        return (all(store.client.exists(store.keys.lease) for store in self.stores)
                and self.stores[0].state() == "running")

    def started(self, updates: int) -> bool:
        """Whether every shard applied ``updates``; raises if a process died meanwhile."""
        dead = [p.name for p in [*self.aggregators, *self.producers] if not p.is_alive()]
        if dead:
            raise RuntimeError(f"benchmark: {', '.join(dead)} exited before the window")
        return self.updates() >= updates

    def pids(self) -> dict[str, int]:
        pids = {f"redis_{i}": node.process.pid for i, node in enumerate(self.nodes)
                if node.process is not None}
        pids.update({f"aggregator_{k}": p.pid for k, p in enumerate(self.aggregators) if p.pid})
        pids.update({f"producer_{i}": p.pid for i, p in enumerate(self.producers) if p.pid})
        return pids


def measure(size: int, shards: int, masters: int, window_s: float, producers: int = 2,
            layout: ParamLayout | None = None, release_pages: bool = False) -> dict[str, Any]:
    """Updates/s of a run of ``size`` parameters in ``shards`` shards on ``masters``
    servers (0: one plain Redis), and what each process spent per update."""
    sizing = Sizing.of(size, shards, producers)
    layout = layout or synthetic_layout(size)
    run_id = spread_run_id(f"bench-s{shards}-m{masters}", shards, masters)
    with servers(masters, release_pages) as (url, nodes):
        client = connect(url)
        try:
            store = RunStore(client, run_id)
            store.create(sizing.config(run_id), layout, np.zeros(layout.size, np.float32))
            rig = Rig(store.shards(), nodes, [], [])
            try:
                rig.aggregators = [start(aggregator_main, url, run_id, LEASE_MS, k,
                                         name=f"aggregator-{k}") for k in range(shards)]
                # Producers start once every shard has a leader, as workers start publishing
                # only once a run is running: a leader whose first read finds entries waiting
                # may read every later gradient twice (docs/performance.md, "Shards").
                wait_for(rig.leading, 120, "every shard's aggregator to lead")
                rig.producers = [start(produce, url, run_id, f"producer-{i}", i,
                                       sizing.max_pending, name=f"producer-{i}")
                                 for i in range(producers)]
                # Past the first max_pending updates the streams are at their bound: from
                # then on, as many gradients are published as applied.
                warm = max(2 * sizing.read_batch, sizing.max_pending)
                wait_for(lambda: rig.started(warm), 300,
                         f"{shards} shards on {masters or 'one'} servers to start")
                result = _window(rig, window_s)
            finally:
                store.request_stop()
                for aggregator in rig.aggregators:
                    aggregator.join(30)
                stop([*rig.aggregators, *rig.producers])
            result["rejected"] = _rejected(rig.stores)
        finally:
            client.close()
    result["stream_fill"] = round(result.pop("mean_stream_length") / sizing.max_pending, 3)
    return {"parameters": layout.size, "shards": shards, "servers": max(masters, 1),
            "cluster": masters > 0, "redis_keeps_pages": not release_pages,
            "producers": producers, "max_pending": sizing.max_pending,
            "read_batch": sizing.read_batch, "kept_snapshots": sizing.kept,
            "shard_mb": round(sizing.shard_bytes / MB, 1), **result}


@dataclass
class _Sample:
    t: float
    updates: int
    cpu: dict[str, float]
    machine_busy: float
    net: list[tuple[int, int]]


def _sample(rig: Rig) -> _Sample:
    cpu = {}
    for label, pid in rig.pids().items():
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            cpu[label] = times.user + times.system
    return _Sample(time.monotonic(), rig.updates(), cpu, _machine_busy(),
                   [_net_bytes(node) for node in rig.nodes])


def _machine_busy() -> float:
    """CPU seconds every process of the machine has used, ours and other tenants'."""
    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq",
                                                  "steal"))


def _net_bytes(node: EmbeddedRedis) -> tuple[int, int]:
    """Bytes the server has received and sent since it started (its own count)."""
    with redis.Redis.from_url(node.url) as client:
        stats: Any = client.info("stats")
    return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])


def _window(rig: Rig, seconds: float) -> dict[str, Any]:
    """Rate and per-update costs over ``seconds`` (longer, up to EXTEND times, until
    MIN_UPDATES were applied); the streams' mean length meanwhile."""
    lengths: list[float] = []
    first = _sample(rig)
    while (time.monotonic() - first.t < seconds
           or (rig.updates() - first.updates < MIN_UPDATES
               and time.monotonic() - first.t < EXTEND * seconds)):
        time.sleep(0.2)
        lengths.append(statistics.fmean(s.client.xlen(s.keys.gradients) for s in rig.stores))
    last = _sample(rig)
    elapsed, updates = last.t - first.t, last.updates - first.updates
    per_update = max(updates, 1)
    cpu = {label: round((last.cpu[label] - first.cpu[label]) / per_update, 4)
           for label in last.cpu if label in first.cpu}
    ours = sum(last.cpu[label] - first.cpu[label] for label in cpu)
    busy = last.machine_busy - first.machine_busy
    return {
        "updates_per_s": round(updates / elapsed, 3), "updates": updates,
        "window_s": round(elapsed, 1),
        "cpu_s_per_update": cpu,
        # Per server: megabytes received and sent per update.
        "net_mb_per_update": {direction: [round((b[i] - a[i]) / per_update / MB, 3)
                                          for a, b in zip(first.net, last.net, strict=True)]
                              for i, direction in enumerate(("in", "out"))},
        "cores_busy": round(busy / elapsed, 2),
        "cores_busy_elsewhere": round(max(busy - ours, 0.0) / elapsed, 2),
        "mean_stream_length": statistics.fmean(lengths) if lengths else 0.0,
    }


def _rejected(stores: list[RunStore]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for store in stores:
        for name, value in store.counters().items():
            if name.startswith("rejected:"):
                totals[name] = totals.get(name, 0) + value
    return totals


def busiest(result: dict[str, Any], role: str) -> float:
    """The CPU seconds per update of the busiest process of a role (redis, aggregator)."""
    return max(v for k, v in result["cpu_s_per_update"].items() if k.startswith(role))


def role_total(result: dict[str, Any], role: str) -> float:
    """CPU seconds per update of every process of a role together."""
    return sum(v for k, v in result["cpu_s_per_update"].items() if k.startswith(role))
