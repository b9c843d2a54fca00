"""A run's metrics series as columns: what the dashboard draws when it compares runs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query

from gemq.state.store import METRICS_MAXLEN, RunStore

from .. import views
from ..deps import STREAM_ID, Reader, Store

router = APIRouter(prefix="/api/runs", tags=["runs"])
#: The numeric fields of a metrics row (gemq.aggregation.window.CommitWindow.metrics writes them).
#: pi_tensors, a list per row, is the heat map's and comes with /metrics only.
COLUMNS = ("t_ms", "updates", "applied", "rejected", "loss", "accuracy", "energy_ratio",
           "median_pi", "staleness_mean", "staleness_max", "active_workers", "e_central",
           "e_proxy", "eval_updates", "test_loss", "test_accuracy")
#: Rows per XRANGE: a whole stream in a few replies, none of them huge.
READ_ROWS = 5000
#: Rows one answer carries at most. The stream is trimmed to about METRICS_MAXLEN rows, so
#: an ended run always fits; a live one grows while it is read, and `last_id` resumes.
MAX_ROWS = METRICS_MAXLEN + READ_ROWS


def parse_fields(text: str | None) -> list[str]:
    """The asked-for columns, in the order asked (all of COLUMNS when none are named)."""
    if text is None:
        return list(COLUMNS)
    asked = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in asked if f not in COLUMNS]
    if unknown or not asked:
        what = f"unknown field {', '.join(map(repr, unknown))}" if unknown else "no field"
        raise HTTPException(422, [{"loc": ["query", "fields"], "type": "value_error",
                                   "msg": f"{what}; choose from {', '.join(COLUMNS)}"}])
    return list(dict.fromkeys(asked))


def read_rows(store: RunStore, after: str) -> list[tuple[str, dict[str, str]]]:
    """Every metrics row newer than ``after`` (at most MAX_ROWS), oldest first."""
    rows: list[tuple[str, dict[str, str]]] = []
    while len(rows) < MAX_ROWS:
        chunk = store.metrics_since(after, min(READ_ROWS, MAX_ROWS - len(rows)))
        rows += chunk
        if len(chunk) < READ_ROWS:
            break
        after = chunk[-1][0]
    return rows


@router.get("/{run_id}/series", dependencies=[Reader], responses={
    404: {"description": "no such run"}, 422: {"description": "an unknown field"}})
def series(store: Store, after: str = Query("0-0", pattern=STREAM_ID),
           fields: str | None = Query(None, description="comma-separated columns "
                                      f"(default all): {', '.join(COLUMNS)}")
           ) -> dict[str, Any]:
    """Every metrics row newer than `after` in one answer, as one array per field."""
    names = parse_fields(fields)
    rows = read_rows(store, after)
    return {"run_id": store.run_id, "count": len(rows),
            "last_id": rows[-1][0] if rows else after,
            "columns": views.metrics_columns(rows, names)}
