"""The API service as users meet it: a real uvicorn process, Redis, rq and workers."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import redis
import torch

from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.records.export import export_curves
from gemq.running.embedded import EmbeddedRedis, free_port
from gemq.state.store import RunStore
from gemq.training.models import LogisticRegression
from tests.helpers import GemqProcess, aggregated_run, gradient_message, small_run, wait_for

TOKEN = "a-test-token-of-24-chars"
TINY = {"model": "logreg", "dataset": "digits", "batch_size": 16}


@dataclass
class Service:
    url: str
    process: GemqProcess

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def start_api(redis_url: str, **env: str) -> Service:
    port = free_port()
    process = GemqProcess("serve", "--redis-url", redis_url, "--port", str(port),
                          env={**os.environ, **env})
    service = Service(f"http://127.0.0.1:{port}", process)

    def up() -> bool:
        try:
            return httpx.get(service.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout_s=60, what=f"API on port {port}: {process.output()}")
    return service


@pytest.fixture
def api(redis_server: EmbeddedRedis) -> Iterator[Service]:
    service = start_api(redis_server.url, GEMQ_API_TOKEN=TOKEN)
    yield service
    service.process.stop()


def test_probes(api: Service) -> None:
    with api.client(None) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").status_code == 200
        assert c.get("/openapi.json").json()["info"]["title"] == "gemq"


def test_readiness_follows_redis(redis_server: EmbeddedRedis, api: Service) -> None:
    with api.client(None) as c:
        redis_server.kill()
        assert c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200
        redis_server.start()
        wait_for(lambda: c.get("/readyz").status_code == 200, what="ready again")


def test_mutations_need_the_token(api: Service) -> None:
    with api.client(None) as anonymous, api.client("wrong-token-of-enough-chars") as wrong:
        assert anonymous.post("/api/runs", json=TINY).status_code == 401
        assert wrong.post("/api/runs", json=TINY).status_code == 403
        assert anonymous.get("/api/runs").json()["runs"] == []  # reads stay open


@pytest.mark.parametrize(("body", "field"), [
    ({"lr": -1}, "lr"), ({"algo": "sgd"}, "algo"), ({"batch_size": 10**7}, "batch_size"),
    ({"dataset": "nope"}, "dataset"), ({"model": "nope", **{"dataset": "digits"}}, "model"),
    ({"epochs": 1, "steps": 5}, "body"), ({"bogus": 1}, "bogus"),
    ({"model": "os:getcwd"}, "model"), ({"dataset": "os:getcwd"}, "dataset"),
])
def test_invalid_configs_are_422_naming_the_field(api: Service, body: dict[str, object],
                                                  field: str) -> None:
    with api.client() as c:
        response = c.post("/api/runs", json=body)
    assert response.status_code == 422
    locations = [e["loc"] for e in response.json()["detail"]]
    # A setting that also takes "auto" is a union: the member's tag follows the field.
    assert any(field in loc[1:] or (field == "body" and loc == ["body"])
               for loc in locations), locations


def test_out_of_range_stream_ids_are_422(api: Service) -> None:
    with api.client() as c:
        assert c.post("/api/runs", json={"run_id": "ids", "start": False, **TINY}
                      ).status_code == 201
        huge = "0955-2250348264365909204715086667"  # found by schemathesis: once a 500
        assert c.get("/api/runs/ids/metrics", params={"after": huge}).status_code == 422
        assert c.get("/api/runs/ids/metrics", params={"after": "1-0"}).status_code == 200


def test_import_specs_are_off_by_default(api: Service) -> None:
    with api.client() as c:
        response = c.post("/api/runs", json={"model": "os:getcwd"})
    assert "GEMQ_ALLOW_IMPORT_SPECS" in response.json()["detail"][0]["msg"]


def test_api_starts_before_redis_and_becomes_ready(redis_server: EmbeddedRedis) -> None:
    redis_server.kill()
    service = start_api(redis_server.url, GEMQ_API_TOKEN=TOKEN)
    try:
        with service.client() as c:
            assert c.get("/readyz").status_code == 503
            assert c.get("/api/runs").status_code == 503
            redis_server.start()
            wait_for(lambda: c.get("/readyz").status_code == 200, what="ready")
            assert c.get("/api/runs").json()["runs"] == []
    finally:
        service.process.stop()


def test_the_run_list_comes_in_pages(redis_client: redis.Redis, api: Service) -> None:
    """All runs can be listed: 105 runs are a page of 100 that says how many there are and
    where the next page starts, then a page of 5 (it once listed 100, silently)."""
    for i in range(105):
        small_run(redis_client, f"many-{i:03d}")
    with api.client(None) as c:
        first = c.get("/api/runs").json()
        rest = c.get("/api/runs", params={"offset": first["next_offset"]}).json()
        small = c.get("/api/runs", params={"limit": 10, "offset": 2}).json()
        for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1},
                    {"offset": 24099117736974688256}):  # once a 500: Redis takes 64 bits
            assert c.get("/api/runs", params=bad).status_code == 422, bad
    assert (first["total"], first["offset"], first["next_offset"]) == (105, 0, 100)
    assert len(first["runs"]) == 100 and len(rest["runs"]) == 5
    assert rest["next_offset"] is None
    listed = [r["run_id"] for r in first["runs"] + rest["runs"]]
    assert sorted(listed) == [f"many-{i:03d}" for i in range(105)]  # each once
    assert [r["run_id"] for r in small["runs"]] == listed[2:12]


def test_start_racing_delete_is_one_or_the_other_never_both_never_a_500(
        redis_client: redis.Redis, api: Service) -> None:
    """30 created runs, each started and deleted at once (and deleted twice more): every
    answer is one the API documents, a deleted run leaves no key and no rq job, and a
    started one is whole. (Before: 10 of 30 starts were 500s, 2 of 30 left a job and a
    status hash for a deleted run, and concurrent DELETEs all answered 200.)"""
    runs = [f"race-{i:02d}" for i in range(30)]
    with api.client() as c:
        for run in runs:
            assert c.post("/api/runs", json={"run_id": run, "start": False, "model": "logreg",
                                             "dataset": "digits"}).status_code == 201

    def call(method: str, run: str) -> int:
        with api.client() as c:
            path = f"/api/runs/{run}" + ("/start" if method == "POST" else "")
            return c.request(method, path).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = {run: [pool.submit(call, m, run) for m in ("POST", "DELETE", "DELETE",
                                                               "DELETE")] for run in runs}
    for run, futures in answers.items():
        started, *deleted = (f.result() for f in futures)
        assert started in (202, 404), (run, started)
        assert sorted(deleted) in ([200, 404, 404], [409, 409, 409]), (run, deleted)
        keys = redis_client.keys(f"gemq:{{{run}}}:*")
        job = redis_client.exists(f"rq:job:gemq-aggregate-{run}")
        if 200 in deleted:
            assert started == 404 or job == 0, (run, started)  # not started first...
            assert keys == [] and not job, (run, keys, job)  # ...and nothing left
        else:
            assert started == 202 and job, (run, started)
            status = redis_client.hgetall(f"gemq:{{{run}}}:status")
            assert status[b"state"] == b"created" and status[b"job_id"], status


def test_unknown_runs_are_404(api: Service) -> None:
    with api.client() as c:
        for path in ("/api/runs/nosuch", "/api/runs/nosuch/metrics", "/api/runs/nosuch/model",
                     "/api/runs/nosuch/metrics.csv"):
            assert c.get(path).status_code == 404
        assert c.post("/api/runs/nosuch/stop").status_code == 404


def test_metrics_csv_is_a_download_of_every_row(redis_server: EmbeddedRedis,
                                               api: Service) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        store = aggregated_run(client, "csv", updates=8)
        expected = io.StringIO()
        export_curves(store, expected, "csv")
    finally:
        client.close()
    with api.client(None) as c:
        response = c.get("/api/runs/csv/metrics.csv")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/csv; charset=utf-8"
    assert response.headers["content-disposition"] == 'attachment; filename="csv-metrics.csv"'
    assert response.text == expected.getvalue()
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert [int(r["updates"]) for r in rows] == list(range(1, 9))


def test_an_ended_runs_counters_count_a_late_gradient_as_unused(
        redis_server: EmbeddedRedis, api: Service) -> None:
    """A worker's publication can cross the run's end: what lies in the stream of an ended
    run is unused, so the view's counters still balance (the container test met it)."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        store = aggregated_run(client, "late", updates=6)
        rng = np.random.default_rng(3)
        late = rng.standard_normal(store.layout().size).astype(np.float32)
        store.publish_gradient("w-late", gradient_message(store, "w-late", late))
    finally:
        client.close()
    with api.client(None) as c:
        counters = c.get("/api/runs/late").json()["counters"]
    rejected = sum(v for k, v in counters.items() if k.startswith("rejected:"))
    assert counters["applied"] == 6
    assert counters["unused"] == 1
    assert counters["published"] == counters["applied"] + rejected + counters["unused"]


@pytest.mark.slow
def test_run_lifecycle_through_rq(redis_server: EmbeddedRedis, api: Service) -> None:
    url = redis_server.url
    aggregator = GemqProcess("aggregator", "--serve", "--redis-url", url)
    worker = GemqProcess("worker", "--follow", "--redis-url", url, "--workers", "2")
    try:
        with api.client() as c:
            created = c.post("/api/runs", json={"run_id": "life", "steps": 100_000, **TINY})
            assert created.status_code == 201, created.text
            assert created.json()["job"]["state"] in ("queued", "started")
            wait_for(lambda: c.get("/api/runs/life").json()["progress"]["updates"] >= 200,
                     timeout_s=120, what="progress")
            view = c.get("/api/runs/life").json()
            assert view["state"] == "running" and view["job"]["state"] == "started"
            assert {w["active"] for w in view["workers"]} == {True}
            assert len(view["workers"]) == 2
            rows = c.get("/api/runs/life/metrics", params={"limit": 5}).json()
            assert len(rows["rows"]) == 5
            later = c.get("/api/runs/life/metrics", params={"after": rows["last_id"]}).json()
            assert later["rows"] and later["rows"][0]["updates"] > rows["rows"][-1]["updates"]
            assert c.post("/api/runs/life/stop").status_code == 202
            wait_for(lambda: c.get("/api/runs/life").json()["state"] == "stopped",
                     what="stopped")
            wait_for(lambda: c.get("/api/runs/life").json()["job"]["state"] == "finished",
                     what="job finished")
            assert c.post("/api/runs/life/stop").status_code == 409
            model = LogisticRegression(64, 10)
            blob = c.get("/api/runs/life/model")
            assert blob.status_code == 200
            model.load_state_dict(torch.load(io.BytesIO(blob.content)))
            scrape = c.get("/metrics").text
            assert 'gemq_updates_applied_total{run="life"}' in scrape
            # the worker service goes back to waiting and joins the next run
            assert c.post("/api/runs", json={"run_id": "next", "steps": 50, **TINY}
                          ).status_code == 201
            wait_for(lambda: c.get("/api/runs/next").json()["state"] == "finished",
                     timeout_s=120, what="second run")
            assert [r["run_id"] for r in c.get("/api/runs").json()["runs"]] == ["next", "life"]
            last_id = c.get("/api/runs/next/metrics").json()["last_id"]
            assert first_event(c, "/api/runs/next/events") == "metrics"
            assert first_event(c, f"/api/runs/next/events?after={last_id}") == "run"
            assert first_event(c, "/api/runs/next/events",
                               headers={"Last-Event-ID": last_id}) == "run"
    finally:
        aggregator.stop()
        worker.stop()


def first_event(client: httpx.Client, path: str, **kwargs: object) -> str:
    """The name of the first Server-Sent Event on ``path``."""
    with client.stream("GET", path, **kwargs) as response:  # type: ignore[arg-type]
        for line in response.iter_lines():
            if line.startswith("event: "):
                return line.removeprefix("event: ")
    raise AssertionError("the stream ended without an event")


def test_without_a_token_only_loopback(redis_server: EmbeddedRedis) -> None:
    process = GemqProcess("serve", "--redis-url", redis_server.url, "--host", "0.0.0.0",
                          "--port", str(free_port()))
    try:
        assert process.wait(60) == 1
        assert "refusing to listen on 0.0.0.0 without GEMQ_API_TOKEN" in process.output()
        assert "Traceback" not in process.output()
    finally:
        process.stop()


def test_placeholder_token_is_refused(redis_server: EmbeddedRedis) -> None:
    process = GemqProcess("serve", "--redis-url", redis_server.url,
                          env={**os.environ, "GEMQ_API_TOKEN": "changeme"})
    try:
        assert process.wait(60) == 2
        assert "GEMQ_API_TOKEN" in process.output()
    finally:
        process.stop()


def test_delete_a_run(redis_server: EmbeddedRedis, api: Service) -> None:
    client = redis.Redis.from_url(redis_server.url)
    aggregator: GemqProcess | None = None
    try:
        with api.client() as c, api.client(None) as anonymous:
            assert c.post("/api/runs", json={"run_id": "gone", "steps": 100_000, **TINY}
                          ).status_code == 201
            # Queued: no aggregator service takes the job here.
            refused = c.delete("/api/runs/gone")
            assert refused.status_code == 409
            assert "queued" in refused.json()["detail"]
            aggregator = GemqProcess("aggregator", "--run", "gone", "--redis-url",
                                     redis_server.url)
            wait_for(lambda: c.get("/api/runs/gone").json()["state"] == "running",
                     what="running")
            assert c.delete("/api/runs/gone").status_code == 409
            assert anonymous.delete("/api/runs/gone").status_code == 401
            assert c.delete("/api/runs/nosuch").status_code == 404
            assert c.post("/api/runs/gone/stop").status_code == 202
            assert aggregator.wait(60) == 0, aggregator.output()
            store = RunStore(client, "gone")
            assert store.state() == "stopped" and len(store.kept_versions()) == 1
            blob = c.get("/api/runs/gone/model")  # an ended run's model is still there
            assert blob.status_code == 200
            LogisticRegression(64, 10).load_state_dict(
                torch.load(io.BytesIO(blob.content), weights_only=True))
            deleted = c.delete("/api/runs/gone")
            assert deleted.status_code == 200, deleted.text
            assert deleted.json()["deleted"] is True and deleted.json()["keys"] >= 7
            assert list(client.scan_iter(match="gemq:{gone*")) == []
            assert list(client.scan_iter(match="rq:job:gemq-aggregate-gone*")) == []
            assert client.llen("rq:queue:gemq-aggregator") == 0
            assert c.get("/api/runs/gone").status_code == 404
            assert c.get("/api/runs").json()["runs"] == []
            assert c.delete("/api/runs/gone").status_code == 404
    finally:
        if aggregator is not None:
            aggregator.stop()
        client.close()


def test_the_service_keeps_the_newest_ended_runs(redis_server: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    layout = ParamLayout.from_shapes([("w", (4,))])
    for i, state in enumerate(["finished", "running", "stopped", "failed", "finished"]):
        store = RunStore(client, f"r{i}")
        store.create(RunConfig.from_dict({"run_id": f"r{i}"}), layout, np.zeros(4, np.float32))
        store.set_status(state=state, ended_ms=1000 + i)
    client.zadd(RunStore(client, "r4").keys.versions, {"3": 3})  # an old snapshot to free
    service = start_api(redis_server.url, GEMQ_API_TOKEN=TOKEN, GEMQ_KEEP_RUNS="2",
                        GEMQ_RETENTION_INTERVAL_S="0.2")
    try:
        with service.client() as c:
            wait_for(lambda: len(c.get("/api/runs").json()["runs"]) == 3, what="retention")
            assert [r["run_id"] for r in c.get("/api/runs").json()["runs"]] == ["r4", "r3", "r1"]
        assert RunStore(client, "r4").kept_versions() == [0]
    finally:
        service.process.stop()
        client.close()
