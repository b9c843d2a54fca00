"""Server-Sent Events: the dashboard's live feed of one run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from gemq.store import RunStore
from services.api import views
from services.api.deps import Reader, Store

router = APIRouter(prefix="/api/runs", tags=["runs"])
#: Seconds between two pushes.
PERIOD_S = 1.0


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _poll(store: RunStore, after: str) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    rows = [views.metrics_row(i, row) for i, row in store.metrics_since(after, 5000)]
    return (rows[-1]["id"] if rows else after), rows, views.run_view(store)


async def _feed(request: Request, store: RunStore) -> AsyncIterator[str]:
    after = "0-0"
    while not await request.is_disconnected():
        after, rows, view = await run_in_threadpool(_poll, store, after)
        if rows:
            yield _event("metrics", {"rows": rows})
        yield _event("run", view)
        await asyncio.sleep(PERIOD_S)


@router.get("/{run_id}/events", dependencies=[Reader],
            responses={200: {"content": {"text/event-stream": {}}}})
def events(request: Request, store: Store) -> StreamingResponse:
    """Live feed: `metrics` events with new rows, `run` events with the run view."""
    return StreamingResponse(_feed(request, store), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
