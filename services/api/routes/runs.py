"""Runs: create, start, list, inspect, stop, delete, metrics, model download."""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from gemq.config import left_to_gemq, make_config
from gemq.errors import ConfigError, RunBusy, RunExists, RunNotFound, SpecError
from gemq.records import combine
from gemq.running.runs import create_run
from gemq.running.sizing import RunTooBig
from gemq.state.retention import delete_run
from gemq.state.serverfit import UnsuitableRedis
from gemq.state.store import ENDED, RunStore, run_count
from gemq.training.data import DataSplit, load_dataset
from gemq.training.specs import is_import_spec

from ...jobs import enqueue_aggregation, forget_job
from .. import views
from ..deps import (
    AUTH_ERRORS,
    BODY_ERRORS,
    STREAM_ID,
    QueueClient,
    Reader,
    RedisClient,
    Settings,
    Store,
    Writer,
)
from ..schemas import RunRequest

router = APIRouter(prefix="/api/runs", tags=["runs"])
#: The largest offset a run list takes: past any index there is, and within the 64-bit
#: integers Redis takes (a larger one was a 500).
MAX_OFFSET = 10**12
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "no such run"}}


@lru_cache(maxsize=8)
def _dataset(spec: str) -> DataSplit:
    return load_dataset(spec)


def _create(client: Any, request: RunRequest, allow_imports: bool) -> RunStore:
    settings = request.settings()
    for field in ("model", "dataset", "loss"):
        if is_import_spec(settings[field]) and not allow_imports:
            raise _unprocessable(field, f"{field} {settings[field]!r}: module:factory "
                                        "specs are disabled on this service "
                                        "(GEMQ_ALLOW_IMPORT_SPECS=true enables them)")
    try:
        data = _dataset(settings["dataset"])
    except SpecError as e:
        raise _unprocessable("dataset", str(e)) from e
    try:
        samples = len(data.train)  # type: ignore[arg-type]
        config = make_config(settings, train_samples=samples)
        return create_run(client, config, data, left_to_gemq=left_to_gemq(settings),
                          workers=request.workers)
    except ConfigError as e:
        raise _unprocessable(e.field, str(e)) from e
    except SpecError as e:
        raise _unprocessable("model", str(e)) from e
    except RunExists as e:
        raise HTTPException(409, str(e)) from e
    except UnsuitableRedis as e:
        raise HTTPException(503, str(e)) from e
    except RunTooBig as e:
        raise HTTPException(507, str(e)) from e


def _unprocessable(field: str, message: str) -> HTTPException:
    return HTTPException(422, [{"loc": ["body", field], "msg": message,
                                "type": "value_error"}])


@router.get("", dependencies=[Reader])
def list_runs(client: RedisClient, queue: QueueClient,
              limit: int = Query(100, ge=1, le=1000, description="runs in this page"),
              offset: int = Query(0, ge=0, le=MAX_OFFSET,
                                  description="runs skipped, newest first")
              ) -> dict[str, Any]:
    """Runs, newest first, with their state and progress: a page of ``limit`` after the
    first ``offset``; ``total`` counts them all, and ``next_offset`` is the next page's
    offset (null after the last page)."""
    total = run_count(client)
    following = offset + limit
    return {"runs": views.list_runs(client, queue, limit, offset), "total": total,
            "offset": offset, "next_offset": following if following < total else None}


@router.post("", status_code=201, dependencies=[Writer],
             responses={**AUTH_ERRORS, **BODY_ERRORS,
                        400: {"description": "the body is not valid JSON"},
                        409: {"description": "a run with this id exists"},
                        422: {"description": "invalid configuration"},
                        503: {"description": "the service's Redis could evict the run's "
                                             "keys (its maxmemory-policy), or is down"},
                        507: {"description": "the run needs more memory than the "
                                             "service's Redis has free (its maxmemory)"}})
async def create(request: RunRequest, client: RedisClient, queue: QueueClient,
                 settings: Settings) -> dict[str, Any]:
    """Create a run from a configuration and, unless start is false, start it."""
    store = await run_in_threadpool(_create, client, request, settings.allow_import_specs)
    if request.start:
        _enqueue(store, queue, settings.aggregator_queue)
    return _view_of(store, lambda: views.run_view(store, queue))


@router.get("/{run_id}", dependencies=[Reader], responses=NOT_FOUND)
def get_run(store: Store, queue: QueueClient) -> dict[str, Any]:
    """One run: configuration, state, job, progress, latest metrics, workers."""
    return views.run_view(store, queue)


@router.post("/{run_id}/start", status_code=202, dependencies=[Writer],
             responses={**NOT_FOUND, **AUTH_ERRORS,
                        409: {"description": "already started or ended"}})
def start(store: Store, queue: QueueClient, settings: Settings) -> dict[str, Any]:
    """Enqueue the aggregation job of a created run."""
    _enqueue(store, queue, settings.aggregator_queue)
    return _view_of(store, lambda: views.run_summary(store, queue))


def _enqueue(store: RunStore, queue: Any, queue_name: str) -> None:
    try:
        enqueue_aggregation(store, queue, queue_name)
    except RunNotFound as e:  # deleted meanwhile
        raise HTTPException(404, str(e)) from e
    except RunBusy as e:  # started meanwhile, or ended
        raise HTTPException(409, str(e)) from e


def _view_of(store: RunStore, view: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A run's view, or a 404 if a deletion took it between the change and the view."""
    try:
        return view()
    except RunNotFound as e:
        raise HTTPException(404, str(e)) from e


@router.post("/{run_id}/stop", status_code=202, dependencies=[Writer],
             responses={**NOT_FOUND, **AUTH_ERRORS,
                        409: {"description": "the run has already ended"}})
def stop(store: Store, queue: QueueClient) -> dict[str, Any]:
    """Ask the aggregator to finish its batch, commit and mark the run stopped."""
    state = store.state()
    if state in ENDED:
        raise HTTPException(409, f"run {store.run_id!r} has already ended ({state}); "
                                 "nothing to stop")
    store.request_stop()
    return {**views.run_summary(store, queue), "stop_requested": True}


@router.delete("/{run_id}", dependencies=[Writer],
               responses={**NOT_FOUND, **AUTH_ERRORS,
                          409: {"description": "the run is running or queued"}})
def delete(run_id: str, client: RedisClient, queue: QueueClient) -> dict[str, Any]:
    """Delete a run that is not running or queued: every key it has in Redis, its place in
    the run list and its rq job."""
    try:
        deleted = delete_run(client, run_id)
    except RunNotFound as e:
        raise HTTPException(404, str(e)) from e
    except RunBusy as e:
        raise HTTPException(409, str(e)) from e
    forget_job(queue, deleted.job_id)
    return {"run_id": run_id, "deleted": True, "keys": deleted.keys}


@router.get("/{run_id}/metrics", dependencies=[Reader], responses=NOT_FOUND)
def metrics(store: Store, after: str = Query("0-0", pattern=STREAM_ID),
            limit: int = Query(1000, ge=1, le=10_000)) -> dict[str, Any]:
    """Metrics rows newer than the stream id ``after``, oldest first."""
    rows = [views.metrics_row(i, row) for i, row in store.metrics_since(after, limit)]
    return {"rows": rows, "last_id": rows[-1]["id"] if rows else after}


@router.get("/{run_id}/model", dependencies=[Reader], responses={
    **NOT_FOUND, 200: {"content": {"application/octet-stream": {}},
                       "description": "a torch state_dict file"}})
def model(store: Store) -> Response:
    """The current parameters as a torch state_dict file (`torch.load(f, weights_only=True)`)."""
    try:
        versions, state = combine.latest_state(store.shards())
    except ValueError:  # bytes that are not float32s at all
        versions, state = (), np.empty(0, np.float32)
    expected = store.layout().size
    if state.size != expected:  # not written by gemq's aggregators: refuse, say why
        raise HTTPException(409, f"run {store.run_id!r}: its stored parameters hold "
                                 f"{state.size} values where its layout has {expected}; "
                                 "its data in Redis is damaged or was written by another "
                                 "program")
    body = _state_dict_bytes(store, state)
    filename = f"{store.run_id}-v{min(versions)}.pt"
    return Response(body, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{filename}"'})


def _state_dict_bytes(store: RunStore, flat: np.ndarray) -> bytes:
    """The state ``flat`` as a torch state_dict, built from the run's stored layout.

    Nothing named in the run's config is imported or called: that config comes from Redis,
    and a download must not run code chosen by whoever could write there (a module:factory
    spec runs only where GEMQ_ALLOW_IMPORT_SPECS lets a request name one). The layout lists
    the model's parameters and persistent buffers, so the file loads into the model with
    ``load_state_dict`` as one saved from the module itself would.
    """
    import torch

    from gemq.training.flatmodel import state_dict_of

    state = state_dict_of(store.layout(), flat)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()
