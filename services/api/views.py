"""JSON views of runs, built from what Redis holds (see docs/api.md)."""

from __future__ import annotations

import json
import math
from typing import Any

import redis

from gemq.errors import RunNotFound
from gemq.records import combine
from gemq.state.store import ENDED, Head, RunState, RunStore, now_ms, run_ids

from ..jobs import job_listeners, job_state

#: A worker silent longer than this (ms) is shown as gone.
ACTIVE_WINDOW_MS = 10_000
#: Metrics rows over which updates/s is measured.
RATE_WINDOW = 20


def metrics_row(entry_id: str, row: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": entry_id}
    for key, value in row.items():
        out[key] = json.loads(value) if key == "pi_tensors" else _number(value)
    return out


def _number(text: str) -> float | int | None:
    try:
        return int(text)
    except ValueError:
        value = float(text)
    return value if math.isfinite(value) else None  # JSON has no NaN


def metrics_columns(rows: list[tuple[str, dict[str, str]]],
                    fields: list[str]) -> dict[str, list[float | int | None]]:
    """Metrics rows as one list per field, in row order; null where a row has no finite
    value for the field."""
    return {f: [_number(row[f]) if f in row else None for _, row in rows] for f in fields}


def updates_per_s(rows: list[dict[str, Any]]) -> float | None:
    if len(rows) < 2 or rows[-1]["t_ms"] <= rows[0]["t_ms"]:
        return None
    return round(1000 * (rows[-1]["updates"] - rows[0]["updates"])
                 / (rows[-1]["t_ms"] - rows[0]["t_ms"]), 2)


def recent_metrics(store: RunStore, count: int = RATE_WINDOW) -> list[dict[str, Any]]:
    return [metrics_row(i, row) for i, row in store.latest_metrics(count)]


def worker_view(worker_id: str, state: dict[str, str], now: int) -> dict[str, Any]:
    last_seen = max(int(state.get("heartbeat_ms", 0)), int(state.get("last_update_ms", 0)))
    applied = int(state.get("applied", 0))
    return {
        "worker_id": worker_id, "last_seen_ms": last_seen or None,
        "active": bool(last_seen) and now - last_seen < ACTIVE_WINDOW_MS,
        "steps": int(state.get("steps", 0)), "applied": applied,
        "last_staleness": int(state["last_staleness"]) if "last_staleness" in state else None,
        "mean_staleness": round(int(state.get("staleness_sum", 0)) / applied, 3)
        if applied else None,
        "rejected": {k.removeprefix("rejected:"): int(v) for k, v in state.items()
                     if k.startswith("rejected:")},
    }


def run_summary(store: RunStore, queue: redis.Redis,
                heads: list[Head] | None = None) -> dict[str, Any]:
    """``queue``: the client of the Redis holding the rq queue (its job's state); ``heads``:
    the shards' heads, when the caller read them already."""
    status, config = store.status(), store.config()
    head = combine.slowest(heads or combine.heads(store.shards()))
    return {
        "run_id": store.run_id, "state": status["state"],
        "job": job_state(queue, status.get("job_id")),
        "algo": config.algo, "model": config.model, "dataset": config.dataset,
        "shard_count": config.shards,
        "progress": {"updates": head.updates, "budget": config.budget_updates,
                     "fraction": round(head.updates / config.budget_updates, 4)},
        **{k: int(status[k]) if k in status else None
           for k in ("created_ms", "started_ms", "ended_ms")},
    }


def _counters(shards: list[RunStore], state: str) -> dict[str, int]:
    """The run's counters; an ended run's unused ones include what is still in its streams,
    so that published = applied + rejected + unused holds (as in gemq run's summary)."""
    counts = combine.counters(shards)
    if state in ENDED:
        counts["unused"] = combine.unused(shards, counts)
    return counts


def run_view(store: RunStore, queue: redis.Redis) -> dict[str, Any]:
    shards = store.shards()
    heads = combine.heads(shards)  # one read for the progress and the shard table
    table = combine.shard_table(shards, heads)
    recent = recent_metrics(store)
    latest = dict(recent[-1]) if recent else {}
    if latest:
        latest["updates_per_s"] = updates_per_s(recent)
    now = now_ms()
    return {
        **run_summary(store, queue, heads),
        "config": json.loads(store.config().to_json()),
        "tensors": [t.name for t in store.layout().params],  # the heat map's rows
        "latest": latest,
        "counters": _counters(shards, store.status()["state"]),
        "shards": table,
        "shards_overall": combine.overall(table),
        # The most recently heard from; the total says how many there are in all.
        "workers": [worker_view(w, s, now) for w, s in store.worker_states().items()],
        "workers_total": store.worker_count(),
        "error": store.status().get("error"),
        "waiting": waiting_for(store, queue, now),
    }


def waiting_for(store: RunStore, queue: redis.Redis, now: int) -> str | None:
    """What a run that makes no progress waits for, where nothing else would tell: no
    aggregator service takes its queued job, or no worker trains it; else None."""
    status = store.status()
    if (status["state"] == RunState.CREATED and status.get("job_id")
            and job_listeners(queue, status["job_id"]) == 0):
        return ("No aggregator service takes jobs from this run's queue: start one (gemq "
                "aggregator --serve; on one machine, gemq serve --local) and the run starts.")
    started = int(status.get("started_ms", 0))
    if (status["state"] == RunState.RUNNING and started and now - started > ACTIVE_WINDOW_MS
            and store.worker_count(since_ms=now - ACTIVE_WINDOW_MS) == 0):
        return ("No worker is training this run: start workers (gemq worker --follow, or "
                f"gemq worker --run {store.run_id}).")
    return None


def list_runs(client: redis.Redis, queue: redis.Redis, limit: int = 100,
              offset: int = 0) -> list[dict[str, Any]]:
    out = []
    for run_id in run_ids(client, limit, offset):
        try:
            out.append(run_summary(RunStore(client, run_id), queue))
        except RunNotFound:
            continue  # deleted behind the index's back
    return out
