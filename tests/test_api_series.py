"""GET /api/runs/{id}/series: a run's metrics as columns, against a real training run, a real
Redis and the API service, and checked against the rows GET /api/runs/{id}/metrics gives."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

import gemq
from gemq.records.curves import HELD_OUT
from gemq.running.embedded import EmbeddedRedis
from gemq.services.api.routes.series import COLUMNS, READ_ROWS, read_rows
from gemq.state.store import RunStore
from tests.helpers import small_run
from tests.test_api import TOKEN, Service, start_api

RUN = "series-run"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, EmbeddedRedis]]:
    """A finished run of 60 updates (mlp on digits, two workers), and the API on its Redis."""
    with EmbeddedRedis() as server:
        out = tmp_path_factory.mktemp("run")
        gemq.train("mlp", "digits", steps=60, workers=2, worker_processes=1, batch_size=16,
                   run_id=RUN, redis_url=server.url, out_dir=out, progress=False)
        service = start_api(server.url, GEMQ_API_TOKEN=TOKEN)
        try:
            yield service, server
        finally:
            service.process.stop()


def _metrics_rows(c: httpx.Client, run: str) -> list[dict[str, Any]]:
    rows = c.get(f"/api/runs/{run}/metrics", params={"limit": 10_000}).json()["rows"]
    assert isinstance(rows, list)
    return rows


@pytest.mark.slow
def test_series_holds_every_metrics_row_as_columns(served: tuple[Service, EmbeddedRedis]
                                                   ) -> None:
    service, _ = served
    with service.client(None) as c:
        rows = _metrics_rows(c, RUN)
        answer = c.get(f"/api/runs/{RUN}/series").json()
    assert len(rows) >= 2 and rows[-1]["updates"] == 60
    # COLUMNS names every number a row carries: none is missing from the series. (A run of
    # 60 updates has no held-out evaluation: rows carry one every eval_every updates.)
    assert set(rows[0]) - {"id", "pi_tensors"} == set(COLUMNS) - set(HELD_OUT)
    assert set(HELD_OUT) <= set(COLUMNS)
    assert answer["run_id"] == RUN and answer["count"] == len(rows)
    assert answer["last_id"] == rows[-1]["id"]
    assert list(answer["columns"]) == list(COLUMNS)
    for name in COLUMNS:
        assert answer["columns"][name] == [row.get(name) for row in rows], name


@pytest.mark.slow
def test_series_after_an_id_and_chosen_fields(served: tuple[Service, EmbeddedRedis]) -> None:
    service, _ = served
    with service.client(None) as c:
        rows = _metrics_rows(c, RUN)
        middle = rows[len(rows) // 2]
        later = c.get(f"/api/runs/{RUN}/series",
                      params={"after": middle["id"], "fields": "loss, updates,loss"}).json()
        caught_up = c.get(f"/api/runs/{RUN}/series", params={"after": rows[-1]["id"]}).json()
    rest = rows[len(rows) // 2 + 1:]
    assert list(later["columns"]) == ["loss", "updates"]  # in the order asked, once each
    assert later["columns"]["updates"] == [r["updates"] for r in rest]
    assert later["columns"]["loss"] == [r["loss"] for r in rest]
    assert later["count"] == len(rest) and later["last_id"] == rows[-1]["id"]
    assert caught_up["count"] == 0 and caught_up["last_id"] == rows[-1]["id"]
    assert caught_up["columns"]["loss"] == []


@pytest.mark.slow
def test_series_refuses_unknown_fields_and_runs(served: tuple[Service, EmbeddedRedis]) -> None:
    service, _ = served
    with service.client(None) as c:
        typo = c.get(f"/api/runs/{RUN}/series", params={"fields": "loss,lsos"})
        empty = c.get(f"/api/runs/{RUN}/series", params={"fields": " , "})
        lists = c.get(f"/api/runs/{RUN}/series", params={"fields": "pi_tensors"})
        assert c.get("/api/runs/nosuch/series").status_code == 404
        assert c.get(f"/api/runs/{RUN}/series", params={"after": "x"}).status_code == 422
    assert typo.status_code == 422
    message = typo.json()["detail"][0]["msg"]
    assert message.startswith("unknown field 'lsos'; choose from t_ms, updates")
    assert empty.status_code == 422 and empty.json()["detail"][0]["msg"].startswith("no field")
    assert lists.status_code == 422  # the heat map's lists stay with /metrics


def test_series_reads_a_long_stream_in_chunks(redis_client: redis.Redis) -> None:
    """More rows than one XRANGE reads: every row comes, once, in stream order."""
    store = small_run(redis_client, "long")
    total = 2 * READ_ROWS + 7
    pipe = redis_client.pipeline(transaction=False)
    for i in range(total):
        pipe.xadd(store.keys.metrics, {"updates": i, "loss": 1 / (i + 1)})
    pipe.execute()
    rows = read_rows(RunStore(redis_client, "long"), "0-0")
    assert [int(r["updates"]) for _, r in rows] == list(range(total))
    after = read_rows(store, rows[READ_ROWS][0])
    assert [int(r["updates"]) for _, r in after] == list(range(READ_ROWS + 1, total))

