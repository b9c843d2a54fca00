"""The end-of-run summary: what was applied, rejected, measured; written as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gemq.store import RunStore


def run_totals(store: RunStore) -> dict[str, Any]:
    """Counts and run-long averages read back from Redis."""
    counters = store.counters()
    head = store.head()
    status = store.status()
    rows = [row for _, row in store.metrics_since("0-0", count=10**6)]
    applied = [int(r["applied"]) for r in rows]
    weight = max(sum(applied), 1)
    started, ended = int(status.get("started_ms", 0)), int(status.get("ended_ms", 0))
    return {
        "run_id": store.run_id,
        "state": status["state"],
        "updates_applied": counters.get("applied", 0),
        "published": counters.get("published", 0),
        "rejected": {k.removeprefix("rejected:"): v for k, v in sorted(counters.items())
                     if k.startswith("rejected:")},
        "unused": counters.get("unused", 0) + store.unconsumed(),
        "version": head.version,
        "staleness_mean": _weighted(rows, "staleness_mean", applied, weight),
        "staleness_max": max((int(r["staleness_max"]) for r in rows), default=0),
        "energy_ratio": _weighted(rows, "energy_ratio", applied, weight),
        "median_pi": _weighted(rows, "median_pi", applied, weight),
        "aggregation_time_s": (ended - started) / 1000 if ended and started else None,
        "metrics_rows": len(rows),
    }


def _weighted(rows: list[dict[str, str]], name: str, weights: list[int], total: int) -> float:
    values = [(float(r[name]), w) for r, w in zip(rows, weights, strict=True)
              if not math.isnan(float(r[name]))]
    return sum(v * w for v, w in values) / total if values else math.nan


def write_json(summary: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return path
