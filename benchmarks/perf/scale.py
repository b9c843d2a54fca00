"""Scale and memory: 100 logical workers packed into a few processes, a fixed budget.

Reports the peak RSS of the aggregator, of each worker process and of redis-server, the
peak stream length and Redis ``used_memory``, sampled every 0.2 s. Targets: Redis memory
bounded (its mean over the last quarter of the run is no higher than over the second
quarter, and its peak is under the design's bound, see ``redis_bound``), aggregator memory linear in
the active workers (the run is made with 50 and with 100 workers: the aggregator's growth
per added worker, over the GEM moment each worker costs it, is about 1), everything under
8 GB.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.perf.common import MB, Budget, Peaks, private_redis, ratio
from benchmarks.perf.system import counter, finish, launch
from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.running.sizing import redis_bytes
from gemq.shards import ShardPlan

NAME = "scale"
PARAMS = 163_790  # the paper CNN
LAYOUT = ParamLayout.from_shapes([("params", (PARAMS,))])
GB8 = 8 * 1024**3


def run(budget: Budget) -> dict[str, Any]:
    # --quick: 20 workers apart, so the aggregator's expected growth (20 moments, 13 MB) stands
    # out of its peak RSS's run-to-run noise (about +-5 MB of 250; 5 apart measured -1.4).
    counts, processes = budget.pick(((50, 100), 4), ((5, 25), 2))
    # --quick: a run of a second or two, so it is sampled 4x as often to fill every quarter.
    runs = {workers: measure(workers, processes, budget.pick(3000, 300),
                             budget.seconds(0.2, 0.05)) for workers in counts}
    return summarise(runs)


def measure(workers: int, processes: int, updates: int, interval_s: float) -> dict[str, Any]:
    config = RunConfig(run_id=f"bench-scale-{workers}", budget_updates=updates)
    with private_redis() as (server, client):
        system = launch(server.url, client, config, workers, processes)
        pids = {"redis": server.process.pid if server.process else 0, **system.pids}
        peaks = Peaks(pids, interval_s=interval_s, extra={
            "stream_length": lambda: client.xlen(system.store.keys.gradients),
            "redis_used_memory": lambda: client.info("memory")["used_memory"],
            "redis_clients_memory": lambda: client.info("memory")["mem_clients_normal"],
            "updates": lambda: counter(system.store, "applied")})
        with peaks:
            finish(system, wait_s=1800)
        elapsed = time.monotonic() - system.started
        counters = system.store.counters()
        rows = system.store.latest_metrics(10**6)
    active = max((int(r["active_workers"]) for _, r in rows), default=0)
    return describe(peaks, config, workers, processes, active, counters, elapsed)


def redis_bound(config: RunConfig, workers: int) -> int:
    """The most memory Redis should need for the run, in bytes: gemq's own bound, which it
    sizes runs by (gemq.running.sizing.redis_bytes)."""
    return redis_bytes(config, ShardPlan.of(LAYOUT, config.shards), workers)


def _early_late_means(peaks: Peaks, label: str) -> tuple[float, float]:
    """Mean of ``label`` over the second quarter of the run and over the last (by updates).

    The first quarter is left out: the snapshot history is still filling up then. Means,
    not peaks: a peak is one 0.2 s sample, and client buffers come and go within that.
    """
    rows = [r for r in peaks.series if label in r and "updates" in r]
    total = max((r["updates"] for r in rows), default=0)
    early = [r[label] for r in rows if total / 4 < r["updates"] <= total / 2]
    late = [r[label] for r in rows if r["updates"] > 3 * total / 4]
    return (statistics.fmean(early) if early else 0.0,
            statistics.fmean(late) if late else 0.0)


def describe(peaks: Peaks, config: RunConfig, workers: int, processes: int, active: int,
             counters: dict[str, int], elapsed: float) -> dict[str, Any]:
    bound = redis_bound(config, workers)
    second, last = _early_late_means(peaks, "redis_used_memory")
    worker_rss = {k: round(v / MB, 1) for k, v in peaks.rss.items() if k.startswith("worker")}
    return {
        "workers": workers, "worker_processes": processes, "active_workers_peak": active,
        "updates": counters.get("applied", 0), "rejected": {
            k: v for k, v in counters.items() if k.startswith("rejected:")},
        "elapsed_s": round(elapsed, 2),
        "peak_rss_bytes": {"aggregator": peaks.rss.get("aggregator", 0),
                           "total": sum(peaks.rss.values())},
        "peak_rss_mb": {"aggregator": round(peaks.rss.get("aggregator", 0) / MB, 1),
                        "redis": round(peaks.rss.get("redis", 0) / MB, 1),
                        "worker_processes": worker_rss,
                        "total": round(sum(peaks.rss.values()) / MB, 1)},
        "peak_stream_length": int(peaks.peak_extra.get("stream_length", 0)),
        "max_pending": config.max_pending,
        "redis_used_memory_mb": {
            "peak": round(peaks.peak_extra.get("redis_used_memory", 0) / MB, 1),
            "second_quarter_mean": round(second / MB, 1),
            "last_quarter_mean": round(last / MB, 1),
            "clients_peak": round(peaks.peak_extra.get("redis_clients_memory", 0) / MB, 1),
            "bound": round(bound / MB, 1)},
        "ratios": {"late_over_early": ratio(last, second),
                   "used_over_bound": ratio(peaks.peak_extra.get("redis_used_memory"), bound)},
    }


def summarise(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    small, large = sorted(runs)
    few, many = runs[small], runs[large]
    growth = many["peak_rss_bytes"]["aggregator"] - few["peak_rss_bytes"]["aggregator"]
    moment = PARAMS * 4
    return {
        "scale": {
            "redis_memory_late_over_early": many["ratios"]["late_over_early"],
            "redis_memory_over_design_bound": max(
                (r["ratios"]["used_over_bound"] or 0.0) for r in runs.values()),
            "total_rss_over_8gb": ratio(many["peak_rss_bytes"]["total"], GB8),
            # ~1: the aggregator grows by one GEM moment per active worker, nothing more.
            "aggregator_growth_per_worker_over_moment": ratio(
                growth / max(many["active_workers_peak"] - few["active_workers_peak"], 1),
                moment),
        },
        "runs": {f"workers_{w}": r for w, r in runs.items()},
    }
