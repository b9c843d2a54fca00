"""The services' own Prometheus metrics: gemq.telemetry's observers as histograms and
counters, the ``gemq_build_info`` gauge, and the HTTP endpoint that serves them.

The aggregator service runs each job in a forked rq work horse, and a standby's runs in its
own threads: metric values must add up across processes. prometheus_client's multiprocess
mode does that (each process writes its values to a file of its own, the endpoint sums the
files), but it is chosen when prometheus_client is first imported: the aggregator service
sets PROMETHEUS_MULTIPROC_DIR before it imports this module. The worker service, one
process, keeps its values in memory. Metric names follow Prometheus' naming rules
(tests/test_telemetry.py walks them); docs/deploy.md lists them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
from collections.abc import Iterator

from prometheus_client import (
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
    values,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from gemq import __version__
from gemq.errors import GemqError
from gemq.telemetry import AggregatorObserver, WorkerObserver

#: Upper bounds (s) of the duration histograms: 0.5 ms (a small batch applied) to 10 s (a
#: large model's step on a slow CPU), about three per decade.
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)
#: Where the endpoint listens: every interface, so a scraper reaches it at the pod's address.
#: It serves these metrics and nothing else.
LISTEN_ADDRESS = "0.0.0.0"


class BuildInfo(Collector):
    """``gemq_build_info{version, python, torch} 1``: which code a target runs. ``torch``
    only where it is installed (the aggregator's image has none)."""

    def collect(self) -> Iterator[Metric]:
        labels = {"version": __version__, "python": platform.python_version()}
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            labels["torch"] = importlib.metadata.version("torch")
        info = GaugeMetricFamily("gemq_build_info", "gemq, Python and torch versions; always 1",
                                 labels=list(labels))
        info.add_metric(list(labels.values()), 1)
        yield info


class PrometheusAggregator(AggregatorObserver):
    def __init__(self) -> None:
        self.apply = Histogram("gemq_aggregator_apply_seconds",
                               "Time to decode, check and apply one read batch of gradients",
                               buckets=DURATION_BUCKETS, registry=None)
        self.commit = Histogram("gemq_aggregator_commit_seconds",
                                "Time of one commit's round trip to Redis, which the next read "
                                "shares: it may wait there for a gradient",
                                buckets=DURATION_BUCKETS, registry=None)
        self.batches = Counter("gemq_aggregator_batches", "Read batches applied",
                               registry=None)
        self.entries = Counter("gemq_aggregator_entries",
                               "Stream entries read: applied, rejected or past the budget",
                               registry=None)
        self.metrics = (self.apply, self.commit, self.batches, self.entries)

    def batch_applied(self, entries: int, seconds: float) -> None:
        self.apply.observe(seconds)
        self.batches.inc()
        self.entries.inc(entries)

    def window_committed(self, entries: int, seconds: float) -> None:
        self.commit.observe(seconds)


class PrometheusWorker(WorkerObserver):
    def __init__(self) -> None:
        self.step = Histogram("gemq_worker_step_seconds",
                              "Time to compute and encode one gradient (forward, backward)",
                              buckets=DURATION_BUCKETS, registry=None)
        self.publish = Histogram("gemq_worker_publish_seconds",
                                 "Time to publish one gradient to Redis (one round trip)",
                                 buckets=DURATION_BUCKETS, registry=None)
        self.published = Counter("gemq_worker_gradients_published", "Gradients published",
                                 registry=None)
        self.published_bytes = Counter("gemq_worker_published_bytes",
                                       "Bytes of gradient messages published", registry=None)
        self.metrics = (self.step, self.publish, self.published, self.published_bytes)

    def step_computed(self, seconds: float) -> None:
        self.step.observe(seconds)

    def gradient_published(self, message_bytes: int, seconds: float) -> None:
        self.publish.observe(seconds)
        self.published.inc()
        self.published_bytes.inc(message_bytes)


def multiprocess() -> bool:
    """Whether prometheus_client keeps metric values in files (PROMETHEUS_MULTIPROC_DIR was
    set when it was first imported)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


def serve_aggregator_metrics(port: int) -> PrometheusAggregator:
    """The endpoint on ``port``, and the observer whose metrics it serves, summed over the
    service and its work horses."""
    if not multiprocess():
        raise GemqError("prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was "
                        "set: the work horses' metrics would be lost")
    observer = PrometheusAggregator()
    registry = CollectorRegistry(auto_describe=True)
    MultiProcessCollector(registry)
    _serve(port, registry)
    return observer


def serve_worker_metrics(port: int) -> PrometheusWorker:
    """The endpoint on ``port``, and the observer whose metrics it serves."""
    observer = PrometheusWorker()
    registry = CollectorRegistry(auto_describe=True)
    if multiprocess():  # set for this process from outside: the values are in files
        MultiProcessCollector(registry)
    else:
        for metric in observer.metrics:
            registry.register(metric)
    _serve(port, registry)
    return observer


def _serve(port: int, registry: CollectorRegistry) -> None:
    # No <counter>_created series: the text format would serve each as a gauge of its own.
    disable_created_metrics()
    registry.register(BuildInfo())
    try:
        start_http_server(port, LISTEN_ADDRESS, registry)
    except OSError as e:
        raise GemqError(f"GEMQ_METRICS_PORT={port}: cannot listen there ({e.strerror})") from e
