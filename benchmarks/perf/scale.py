"""Scale and memory: 100 logical workers packed into a few processes, a fixed budget.

Reports the peak RSS of the aggregator, of each worker process and of redis-server, the
peak stream length and Redis ``used_memory``, sampled every 0.2 s. Targets: Redis memory
bounded by backpressure (its peak over the last quarter of the run is no higher than over
the second quarter, and under the design's bound (max_pending + workers) x message + history x
parameters + metrics), aggregator memory linear in active workers, everything under 8 GB.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.perf.common import MB, Budget, Peaks, private_redis, ratio
from benchmarks.perf.system import counter, finish, launch
from gemq.config import RunConfig
from gemq.store import METRICS_MAXLEN

NAME = "scale"
PARAMS = 163_790  # the paper CNN
GB8 = 8 * 1024**3
METRICS_ENTRY_BYTES = 400  # one metrics row, generously (fields and stream overhead)


def run(budget: Budget) -> dict[str, Any]:
    workers, processes = budget.pick((100, 4), (10, 2))
    config = RunConfig(run_id="bench-scale", budget_updates=budget.pick(1500, 120))
    with private_redis() as (server, client):
        system = launch(server.url, client, config, workers, processes)
        pids = {"redis": server.process.pid if server.process else 0, **system.pids}
        peaks = Peaks(pids, extra={
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
    return summarise(peaks, config, workers, processes, active, counters, elapsed)


def _early_late_peaks(peaks: Peaks, label: str) -> tuple[float, float]:
    """Peak of ``label`` over the second quarter of the run and over the last (by updates).

    The first quarter is left out: the snapshot history is still filling up then.
    """
    rows = [r for r in peaks.series if label in r and "updates" in r]
    total = max((r["updates"] for r in rows), default=0)
    early = [r[label] for r in rows if total / 4 < r["updates"] <= total / 2]
    late = [r[label] for r in rows if r["updates"] > 3 * total / 4]
    return max(early, default=0.0), max(late, default=0.0)


def summarise(peaks: Peaks, config: RunConfig, workers: int, processes: int, active: int,
              counters: dict[str, int], elapsed: float) -> dict[str, Any]:
    message = PARAMS * 4 + 200
    bound = ((config.max_pending + workers) * message + config.history * PARAMS * 4
             + METRICS_MAXLEN * METRICS_ENTRY_BYTES)
    first, second = _early_late_peaks(peaks, "redis_used_memory")
    worker_rss = {k: round(v / MB, 1) for k, v in peaks.rss.items() if k.startswith("worker")}
    total = sum(peaks.rss.values())
    aggregator_floor = min((r["aggregator"] for r in peaks.series if "aggregator" in r),
                           default=0.0)
    moments = active * PARAMS * 4
    return {
        "scale": {
            "redis_memory_late_over_early": ratio(second, first),
            "redis_memory_over_backpressure_bound": ratio(
                peaks.peak_extra.get("redis_used_memory"), bound),
            "total_rss_over_8gb": ratio(total, GB8),
            "aggregator_growth_over_worker_moments": ratio(
                peaks.rss.get("aggregator", 0) - aggregator_floor, moments + config.history
                * PARAMS * 4),
        },
        "workers": workers, "worker_processes": processes, "active_workers_peak": active,
        "updates": counters.get("applied", 0), "rejected": {
            k: v for k, v in counters.items() if k.startswith("rejected:")},
        "elapsed_s": round(elapsed, 2),
        "peak_rss_mb": {"aggregator": round(peaks.rss.get("aggregator", 0) / MB, 1),
                        "redis": round(peaks.rss.get("redis", 0) / MB, 1),
                        "worker_processes": worker_rss, "total": round(total / MB, 1)},
        "peak_stream_length": int(peaks.peak_extra.get("stream_length", 0)),
        "max_pending": config.max_pending,
        "redis_used_memory_mb": {"peak": round(peaks.peak_extra.get(
            "redis_used_memory", 0) / MB, 1), "second_quarter_peak": round(first / MB, 1),
            "clients_peak": round(peaks.peak_extra.get("redis_clients_memory", 0) / MB, 1),
            "last_quarter_peak": round(second / MB, 1), "bound": round(bound / MB, 1)},
    }
