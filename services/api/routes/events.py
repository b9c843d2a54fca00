"""Server-Sent Events: the dashboard's live feed of one run."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis
from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from gemq.errors import RunNotFound
from gemq.state.connection import TRANSIENT_ERRORS
from gemq.state.store import RunStore

from .. import views
from ..deps import STREAM_ID, Reader, Store

log = logging.getLogger(__name__)
router = APIRouter(prefix="/api/runs", tags=["runs"])
#: Seconds between two pushes.
PERIOD_S = 1.0


def _event(name: str, data: Any, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {name}\ndata: {json.dumps(data)}\n\n"


def _poll(store: RunStore, queue: redis.Redis,
          after: str) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    rows = [views.metrics_row(i, row) for i, row in store.metrics_since(after, 5000)]
    return (rows[-1]["id"] if rows else after), rows, views.run_view(store, queue)


async def _feed(request: Request, store: RunStore, after: str) -> AsyncIterator[str]:
    try:
        while not await request.is_disconnected():
            after, rows, view = await run_in_threadpool(_poll, store, request.app.state.queue,
                                                        after)
            if rows:  # the id lets a reconnecting EventSource resume (Last-Event-ID)
                yield _event("metrics", {"rows": rows}, event_id=after)
            yield _event("run", view)
            await asyncio.sleep(PERIOD_S)
    except TRANSIENT_ERRORS as e:
        # The response has started: no 503 can be sent. Ending the stream is the signal;
        # the browser's EventSource reconnects by itself, from its Last-Event-ID.
        log.warning("events of run %s: Redis unreachable (%s); stream ended", store.run_id, e)
    except RunNotFound:
        # Deleted while watched: the stream ends, and the browser's reconnection gets a 404.
        log.info("events of run %s: the run was deleted; stream ended", store.run_id)


@router.get("/{run_id}/events", dependencies=[Reader],
            responses={200: {"content": {"text/event-stream": {}}}})
def events(request: Request, store: Store,
           after: str = Query("0-0", pattern=STREAM_ID),
           last_event_id: str | None = Header(None, pattern=STREAM_ID)) -> StreamingResponse:
    """Live feed: `metrics` events with rows newer than `after` (or the Last-Event-ID a
    reconnecting client sends), `run` events with the run view."""
    start = last_event_id or after
    return StreamingResponse(_feed(request, store, start), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
