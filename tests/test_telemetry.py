"""Prometheus metrics as a scraper sees them: the API's /metrics and the aggregator and
worker services' own endpoints, scraped over HTTP from real processes on a real Redis,
parsed with prometheus_client's text parser and walked against Prometheus' naming rules."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import redis
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gemq import __version__
from gemq.aggregation.aggregator import Aggregator, AggregatorOptions
from gemq.config import RunConfig
from gemq.records import combine
from gemq.running.embedded import EmbeddedRedis, free_port
from gemq.running.runs import create_run
from gemq.services.jobs import enqueue_aggregation
from gemq.state.store import RunState, RunStore
from tests.helpers import SMALL_LAYOUT, GemqProcess, gradient_message, small_run, wait_for
from tests.test_api import start_api

#: Units Prometheus names carry: base units only (no _ms, _kb, ...), and _ratio.
UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio")
NOT_BASE_UNITS = re.compile(r"_(ms|millis|milliseconds|us|micros|ns|minutes|hours|kb|mb|gb|"
                            r"kib|mib|gib|percent)(_|$)")
#: Names that are a rate computed in advance: PROMETHEUS's rate() does that.
PRECOMPUTED_RATE = re.compile(r"per_(second|sec|s|minute)|_rate$|_ps$")
#: What the API exported before these names: none may come back.
RETIRED = {"gemq_rejected", "gemq_updates_per_second"}


def families(text: str) -> dict[str, Metric]:
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert parsed, "nothing to parse"
    return parsed


def naming_problems(parsed: dict[str, Metric]) -> list[str]:
    """Every way the families break Prometheus' naming rules (prometheus.io/docs/practices/
    naming): gemq_ prefix, counters and only counters end in _total, units are base units,
    histograms name theirs, no precomputed rates, dimensions are labels (no label value in
    a name), *_info gauges are 1."""
    problems = []
    for name, family in parsed.items():
        samples = {s.name for s in family.samples}
        if not name.startswith("gemq_"):
            problems.append(f"{name}: no gemq_ prefix")
        if PRECOMPUTED_RATE.search(name):
            problems.append(f"{name}: a precomputed rate")
        if NOT_BASE_UNITS.search(name):
            problems.append(f"{name}: not a base unit")
        if family.type == "counter":
            problems += [f"{s}: a counter sample without _total" for s in samples
                         if not s.endswith("_total")]
        elif any(s.endswith("_total") for s in samples):
            problems.append(f"{name}: a {family.type} named like a counter")
        if family.type == "histogram" and not name.endswith(UNIT_SUFFIXES):
            problems.append(f"{name}: a histogram without its unit")
        if name.endswith("_info") and (family.type != "gauge"
                                       or {s.value for s in family.samples} != {1.0}):
            problems.append(f"{name}: an info metric must be a gauge of 1")
        for sample in family.samples:
            problems += [f"{sample.name}: label value {v!r} in the name"
                         for v in sample.labels.values() if len(v) > 2 and v in sample.name]
    return problems


def scrape(url: str) -> dict[str, Metric]:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")  # exposition
    parsed = families(response.text)
    assert naming_problems(parsed) == []
    return parsed


def value(parsed: dict[str, Metric], sample: str, **labels: str) -> float:
    found = [s.value for family in parsed.values() for s in family.samples
             if s.name == sample and s.labels == labels]
    assert len(found) == 1, (sample, labels, found)
    return float(found[0])


def assert_build_info(parsed: dict[str, Metric]) -> None:
    (info,) = parsed["gemq_build_info"].samples
    expected = {"version": __version__, "python": platform.python_version(),
                "torch": importlib.metadata.version("torch")}  # installed here
    assert (info.labels, info.value) == (expected, 1.0)


def assert_histogram(parsed: dict[str, Metric], name: str, count: float) -> None:
    """``count`` observations, in cumulative buckets that end in +Inf, with a positive sum."""
    samples = parsed[name].samples
    buckets = [s for s in samples if s.name == f"{name}_bucket"]
    counts = [b.value for b in buckets]
    assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf", buckets
    assert value(parsed, f"{name}_count") == counts[-1] == count, (name, counts, count)
    assert value(parsed, f"{name}_sum") > 0


# ---- the walk itself can fail -------------------------------------------------------


def test_the_naming_walk_catches_each_rule() -> None:
    text = """# HELP gemq_updates_per_second Updates per second
# TYPE gemq_updates_per_second gauge
gemq_updates_per_second{run="r1"} 4.0
# HELP gemq_applied_total Applied
# TYPE gemq_applied_total gauge
gemq_applied_total 3.0
# HELP gemq_wait_ms Waits
# TYPE gemq_wait_ms histogram
gemq_wait_ms_bucket{le="+Inf"} 1.0
gemq_wait_ms_count 1.0
gemq_wait_ms_sum 2.0
# HELP gemq_run_abc123_loss Loss
# TYPE gemq_run_abc123_loss gauge
gemq_run_abc123_loss{run="abc123"} 0.5
# HELP other_build_info Build
# TYPE other_build_info gauge
other_build_info{version="1"} 2.0
"""
    problems = "\n".join(naming_problems(families(text)))
    for expected in ("gemq_updates_per_second: a precomputed rate",
                     "gemq_applied_total: a gauge named like a counter",
                     "gemq_wait_ms: not a base unit", "gemq_wait_ms: a histogram without",
                     "label value 'abc123' in the name", "other_build_info: no gemq_ prefix",
                     "other_build_info: an info metric"):
        assert expected in problems, problems


def test_the_library_loops_import_no_metrics_package() -> None:
    """Timing hooks cost the library nothing to import: the exporters live in the services."""
    code = ("import sys, gemq.aggregation.aggregator, gemq.training.worker, gemq.running.local\n"
            "assert 'prometheus_client' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- the API ------------------------------------------------------------------------


def _run_with_history(client: redis.Redis) -> RunStore:
    """A run of 30 updates from three workers, and one rejected message."""
    store = small_run(client, "scraped", budget_updates=30)
    store.publish_gradient("w0", b"\x93not a gradient")
    rng = np.random.default_rng(0)
    for i in range(30):
        worker = f"w{i % 3}"
        gradient = rng.standard_normal(SMALL_LAYOUT.size).astype(np.float32)
        store.publish_gradient(worker, gradient_message(store, worker, gradient, version=0))
    result: list[str] = []
    options = AggregatorOptions(lease_ms=1000, idle_block_ms=50)
    thread = threading.Thread(target=lambda: result.append(Aggregator(store, options).run()))
    thread.start()
    thread.join(60)
    assert result == [RunState.FINISHED]
    return store


def test_the_api_metrics_parse_and_follow_the_naming_rules(
        redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    # The API starts first: a worker counts as active for 10 s after its last gradient, and
    # starting the API on a loaded machine can take longer than that.
    api = start_api(redis_server.url, GEMQ_LOG_FORMAT="json")
    try:
        store = _run_with_history(redis_client)
        parsed = scrape(api.url + "/metrics")
    finally:
        api.process.stop()
    assert not RETIRED & set(parsed)
    assert {name: family.type for name, family in parsed.items()} == {
        "gemq_updates_applied": "counter", "gemq_gradients_published": "counter",
        "gemq_gradients_rejected": "counter", "gemq_staleness_mean": "gauge",
        "gemq_energy_ratio": "gauge", "gemq_active_workers": "gauge",
        "gemq_shard_backlog": "gauge", "gemq_shard_staleness_mean": "gauge",
        "gemq_shard_energy_ratio": "gauge", "gemq_shard_median_pi": "gauge",
        "gemq_build_info": "gauge"}
    counters = store.counters()
    run = {"run": "scraped"}
    assert value(parsed, "gemq_updates_applied_total", **run) == counters["applied"] == 30
    assert value(parsed, "gemq_gradients_published_total", **run) == counters["published"] == 31
    rejected = {k.removeprefix("rejected:"): v for k, v in counters.items()
                if k.startswith("rejected:")}
    assert sum(rejected.values()) == 1
    for reason, count in rejected.items():
        assert value(parsed, "gemq_gradients_rejected_total", **run, reason=reason) == count
    assert value(parsed, "gemq_active_workers", **run) == 3
    assert value(parsed, "gemq_staleness_mean", **run) >= 0
    # A run of one shard: its shard's gauges are the run's.
    assert value(parsed, "gemq_shard_staleness_mean", **run, shard="0") == value(
        parsed, "gemq_staleness_mean", **run)
    assert value(parsed, "gemq_shard_energy_ratio", **run, shard="0") == value(
        parsed, "gemq_energy_ratio", **run)
    assert value(parsed, "gemq_shard_backlog", **run, shard="0") == 0  # finished: released
    assert_build_info(parsed)


def test_a_sharded_runs_gauges_combine_its_shards_and_name_each(
        redis_client: redis.Redis) -> None:
    from gemq.services.api.routes.metrics import RunCollector
    from tests.test_shards import lockstep

    lockstep(redis_client, "scraped-shards", 12, algo="gem", shards=3)
    samples = {(s.name, s.labels.get("shard")): s.value
               for family in RunCollector(redis_client).collect() for s in family.samples
               if s.labels.get("run") == "scraped-shards"}
    table = combine.shard_table(RunStore(redis_client, "scraped-shards").shards())
    overall = combine.overall(table)
    assert samples[("gemq_energy_ratio", None)] == pytest.approx(overall["energy_ratio"])
    assert samples[("gemq_staleness_mean", None)] == pytest.approx(overall["staleness_mean"])
    for shard in table:
        for name, field in (("gemq_shard_energy_ratio", "energy_ratio"),
                            ("gemq_shard_median_pi", "median_pi"),
                            ("gemq_shard_staleness_mean", "staleness_mean"),
                            ("gemq_shard_backlog", "backlog")):
            assert samples[(name, str(shard["shard"]))] == pytest.approx(shard[field])
    ratios = [samples[("gemq_shard_energy_ratio", str(k))] for k in range(3)]
    assert len(set(ratios)) == 3  # three shards, three ratios: not shard 0's thrice


# ---- the aggregator and worker services -----------------------------------------------


def _service(*args: str, port: int) -> GemqProcess:
    env = {**os.environ, "GEMQ_METRICS_PORT": str(port), "GEMQ_LOG_FORMAT": "json"}
    return GemqProcess(*args, env=env)


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_up(url: str, service: GemqProcess) -> None:
    wait_for(lambda: _up(url) or service.process.poll() is not None, timeout_s=60,
             what=url)
    assert _up(url), service.output()


def test_a_taken_metrics_port_is_one_clear_error(redis_server: EmbeddedRedis) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = _service("aggregator", "--serve", "--redis-url", redis_server.url, port=port)
        try:
            code, output = service.wait(60), service.output()
        finally:
            service.stop()
    assert code == 1
    assert output.splitlines() == [f"gemq: error: GEMQ_METRICS_PORT={port}: cannot listen "
                                   "there (Address already in use)"]


@pytest.mark.slow
def test_the_services_serve_their_histograms(redis_server: EmbeddedRedis,
                                             redis_client: redis.Redis) -> None:
    url = redis_server.url
    ports = {"aggregator": free_port(), "worker": free_port()}
    aggregator = _service("aggregator", "--serve", "--redis-url", url, "--lease-ms", "1000",
                          port=ports["aggregator"])
    worker = _service("worker", "--follow", "--redis-url", url, "--workers", "2",
                      port=ports["worker"])
    endpoints = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    try:
        _wait_up(endpoints["aggregator"], aggregator)
        _wait_up(endpoints["worker"], worker)
        store = create_run(redis_client, RunConfig(run_id="timed", model="logreg",
                                                   dataset="digits", batch_size=16,
                                                   budget_updates=80))
        enqueue_aggregation(store, redis_client, "gemq-aggregator", lease_ms=1000)
        wait_for(lambda: store.state() == RunState.FINISHED, timeout_s=120, what="the run")
        # The run's job ran in an rq work horse, gone by now: its values are still counted.
        wait_for(lambda: "gemq_aggregator_batches" in families(httpx.get(
            endpoints["aggregator"]).text), timeout_s=10, what="the horse's metrics")
        # The workers leave the run at its end (after a last gradient or two): then every
        # gradient they published is counted, here and in Redis.
        wait_for(lambda: "over for us" in worker.output(), timeout_s=30, what="the workers")
        served = {name: scrape(endpoint) for name, endpoint in endpoints.items()}
        counters = store.counters()
        logs = {"aggregator": aggregator.output(), "worker": worker.output()}
    finally:
        aggregator.stop()
        worker.stop()
    agg, wrk = served["aggregator"], served["worker"]
    batches = value(agg, "gemq_aggregator_batches_total")
    assert batches >= 1
    assert value(agg, "gemq_aggregator_entries_total") >= counters["applied"] == 80
    assert_histogram(agg, "gemq_aggregator_apply_seconds", batches)
    assert value(agg, "gemq_aggregator_commit_seconds_count") >= 1
    assert_histogram(agg, "gemq_aggregator_commit_seconds",
                     value(agg, "gemq_aggregator_commit_seconds_count"))
    published = value(wrk, "gemq_worker_gradients_published_total")
    assert published == counters["published"] >= 80
    assert_histogram(wrk, "gemq_worker_step_seconds", published)
    assert_histogram(wrk, "gemq_worker_publish_seconds", published)
    assert value(wrk, "gemq_worker_published_bytes_total") > published * 4 * 64 * 10
    for parsed in served.values():
        assert_build_info(parsed)
    for name, output in logs.items():
        lines = [json.loads(line) for line in output.splitlines() if line.strip()]
        assert lines and all({"time", "level", "logger", "message"} <= set(e) for e in lines)
        assert any(e.get("run") == "timed" for e in lines), (name, output)
