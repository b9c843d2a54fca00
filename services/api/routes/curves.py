"""A run's curves as a CSV file: the dashboard's "Download CSV"."""

from __future__ import annotations

import io
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

from gemq.errors import RunNotFound
from gemq.records.export import export_curves

from ..deps import Reader, Store

router = APIRouter(prefix="/api/runs", tags=["runs"])
RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {"description": "no such run"},
    200: {"content": {"text/csv": {}},
          "description": "a header line, then one row per metrics entry, oldest first"}}


@router.get("/{run_id}/metrics.csv", dependencies=[Reader], response_class=Response,
            responses=RESPONSES)
def metrics_csv(store: Store) -> Response:
    """Every metrics row the run's stream holds, as a CSV download (`gemq export`'s format)."""
    body = io.StringIO()
    try:
        export_curves(store, body, "csv")
    except RunNotFound as e:  # deleted since the route found it
        raise HTTPException(404, str(e)) from e
    return Response(body.getvalue(), media_type="text/csv", headers={
        "Content-Disposition": f'attachment; filename="{store.run_id}-metrics.csv"'})
