"""Prometheus metrics, read from Redis at scrape time (the API keeps no counters itself)."""

from __future__ import annotations

from collections.abc import Iterator

import redis
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gemq import combine
from gemq.store import RunStore, now_ms, run_ids

from .. import views
from ..deps import RedisClient

router = APIRouter(tags=["health"])
#: Runs exported per scrape, newest first.
EXPORTED_RUNS = 20


class RunCollector(Collector):
    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        applied = CounterMetricFamily("gemq_updates_applied", "Gradient updates applied",
                                      labels=["run"])
        rejected = CounterMetricFamily("gemq_rejected", "Gradients rejected, by reason",
                                       labels=["run", "reason"])
        gauges = {name: GaugeMetricFamily(f"gemq_{name}", text, labels=["run"]) for name, text
                  in (("updates_per_second", "Updates applied per second, recent"),
                      ("staleness_mean", "Mean staleness of the last batch"),
                      ("energy_ratio", "E_central / E_proxy of the last batch"),
                      ("active_workers", "Workers heard from in the last 10 s"))}
        for run_id in run_ids(self.client, EXPORTED_RUNS):
            self._run(RunStore(self.client, run_id), applied, rejected, gauges)
        yield from (applied, rejected, *gauges.values())

    def _run(self, store: RunStore, applied: CounterMetricFamily,
             rejected: CounterMetricFamily, gauges: dict[str, GaugeMetricFamily]) -> None:
        run = store.run_id
        counters = combine.counters(store.shards())
        applied.add_metric([run], counters.get("applied", 0))
        for key, value in counters.items():
            if key.startswith("rejected:"):
                rejected.add_metric([run, key.removeprefix("rejected:")], value)
        recent = views.recent_metrics(store)
        latest = recent[-1] if recent else {}
        now = now_ms()
        workers = [views.worker_view(w, s, now) for w, s in store.worker_states().items()]
        values = {"updates_per_second": views.updates_per_s(recent),
                  "staleness_mean": latest.get("staleness_mean"),
                  "energy_ratio": latest.get("energy_ratio"),
                  "active_workers": sum(w["active"] for w in workers)}
        for name, value in values.items():
            if value is not None:
                gauges[name].add_metric([run], float(value))


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(client: RedisClient) -> Response:
    """Prometheus text format: per-run updates, rejections, rate, staleness, energy."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(client))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
