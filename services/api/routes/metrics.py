"""Prometheus metrics, read from Redis at scrape time (the API keeps no counters itself).

Names follow Prometheus' conventions: what is counted is in the name, counters end in
``_total``, a run is a label, and rates are left to PromQL (``rate(...)``). docs/api.md
lists the families and the names they replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gemq.records import combine
from gemq.state.store import RunStore, now_ms, run_ids

from ...telemetry import BuildInfo
from .. import views
from ..deps import RedisClient

router = APIRouter(tags=["health"])
#: Runs exported per scrape, newest first.
EXPORTED_RUNS = 20
#: Counter families: name (without _total), help, and the run counter each one reads.
COUNTERS = (("gemq_updates_applied", "Gradient updates applied to the parameters", "applied"),
            ("gemq_gradients_published", "Gradients workers published to the run",
             "published"))
#: Gauge families, by name: their help text.
GAUGES = {
    "gemq_staleness_mean": "Mean staleness (updates between the parameters a gradient was "
                           "computed on and those it was applied to) over the last commit "
                           "(a sharded run's: the mean of its shards')",
    "gemq_energy_ratio": "E_central / E_proxy over the last commit (a sharded run's: its "
                         "shards' energies summed; GEM aims at 1)",
    "gemq_active_workers": "Workers heard from in the last 10 s",
}
#: Per-shard gauge families (labels run and shard; shard 0 alone for a run of one shard):
#: help text, and the shard table's field each one reads (gemq/records/combine.py: shard_table).
SHARD_GAUGES = {
    "gemq_shard_backlog": ("Gradient slices in the shard's stream not yet committed (what "
                           "workers compare with max_pending)", "backlog"),
    "gemq_shard_staleness_mean": ("Mean staleness of the shard's last commit, in updates",
                                  "staleness_mean"),
    "gemq_shard_energy_ratio": ("E_central / E_proxy of the shard's last commit",
                                "energy_ratio"),
    "gemq_shard_median_pi": ("Median GEM scale pi of the shard's last commit", "median_pi"),
}


class RunCollector(Collector):
    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        counters = {name: CounterMetricFamily(name, text, labels=["run"])
                    for name, text, _ in COUNTERS}
        rejected = CounterMetricFamily("gemq_gradients_rejected",
                                       "Gradients rejected, by reason", labels=["run", "reason"])
        gauges = {name: GaugeMetricFamily(name, text, labels=["run"])
                  for name, text in GAUGES.items()}
        shard_gauges = {name: GaugeMetricFamily(name, text, labels=["run", "shard"])
                        for name, (text, _) in SHARD_GAUGES.items()}
        for run_id in run_ids(self.client, EXPORTED_RUNS):
            store = RunStore(self.client, run_id)
            table = combine.shard_table(store.shards())
            self._counters(store, counters, rejected)
            self._gauges(store, table, gauges)
            self._shard_gauges(store, table, shard_gauges)
        yield from (*counters.values(), rejected, *gauges.values(), *shard_gauges.values())

    @staticmethod
    def _counters(store: RunStore, families: dict[str, CounterMetricFamily],
                  rejected: CounterMetricFamily) -> None:
        counts = combine.counters(store.shards())
        for name, _, key in COUNTERS:
            families[name].add_metric([store.run_id], counts.get(key, 0))
        for key, value in counts.items():
            if key.startswith("rejected:"):
                rejected.add_metric([store.run_id, key.removeprefix("rejected:")], value)

    @staticmethod
    def _gauges(store: RunStore, table: list[dict[str, Any]],
                families: dict[str, GaugeMetricFamily]) -> None:
        if len(table) > 1:  # run-wide: the shards' energies summed, their mean staleness
            latest = combine.overall(table)
        else:
            recent = views.recent_metrics(store, 1)
            latest = recent[-1] if recent else {}
        now = now_ms()
        workers = [views.worker_view(w, s, now) for w, s in store.worker_states().items()]
        values = {"gemq_staleness_mean": latest.get("staleness_mean"),
                  "gemq_energy_ratio": latest.get("energy_ratio"),
                  "gemq_active_workers": sum(w["active"] for w in workers)}
        for name, value in values.items():
            if value is not None:
                families[name].add_metric([store.run_id], float(value))

    @staticmethod
    def _shard_gauges(store: RunStore, table: list[dict[str, Any]],
                      families: dict[str, GaugeMetricFamily]) -> None:
        for shard in table:
            for name, (_, field) in SHARD_GAUGES.items():
                if shard[field] is not None:
                    families[name].add_metric([store.run_id, str(shard["shard"])],
                                              float(shard[field]))


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(client: RedisClient) -> Response:
    """Prometheus text format: per-run updates, gradients, rejections, staleness, energy."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(client))
    registry.register(BuildInfo())
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
