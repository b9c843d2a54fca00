"""The end-of-run summary: what was applied, rejected, measured; written as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gemq import combine
from gemq.store import RunStore


def run_totals(store: RunStore) -> dict[str, Any]:
    """Counts and run-long averages read back from Redis (combined over the run's shards:
    gemq/combine.py). The averages come from shard 0's metrics, where every shard's would
    agree (loss, staleness), and from every shard's energies for the energy ratio."""
    shards = store.shards()
    counters = combine.counters(shards)
    status = store.status()
    rows_by_shard = [[row for _, row in s.metrics_since("0-0", count=10**6)] for s in shards]
    rows = rows_by_shard[0]
    applied = [int(r["applied"]) for r in rows]
    weight = max(sum(applied), 1)
    started, ended = int(status.get("started_ms", 0)), int(status.get("ended_ms", 0))
    totals = {
        "run_id": store.run_id,
        "state": status["state"],
        "updates_applied": counters.get("applied", 0),
        "published": counters.get("published", 0),
        "rejected": {k.removeprefix("rejected:"): v for k, v in sorted(counters.items())
                     if k.startswith("rejected:")},
        "unused": counters.get("unused", 0) + max(s.unconsumed() for s in shards),
        "version": combine.slowest(combine.heads(shards)).version,
        "staleness_mean": _weighted(rows, "staleness_mean", applied, weight),
        "staleness_max": max((int(r["staleness_max"]) for r in rows), default=0),
        "energy_ratio": _energy_ratio([r for shard in rows_by_shard for r in shard]),
        "median_pi": _weighted(rows, "median_pi", applied, weight),
        "aggregation_time_s": (ended - started) / 1000 if ended and started else None,
        "metrics_rows": len(rows),
    }
    if len(shards) > 1:
        totals["shards"] = combine.shard_table(shards)
    return totals


def _energy_ratio(rows: list[dict[str, str]]) -> float:
    """Sum of the central energies over sum of the proxies' (GEM's ratio, over the run)."""
    central = sum(float(r.get("e_central", 0.0)) for r in rows)
    proxy = sum(float(r.get("e_proxy", 0.0)) for r in rows)
    return central / proxy if proxy > 0 else math.nan


def _weighted(rows: list[dict[str, str]], name: str, weights: list[int], total: int) -> float:
    values = [(float(r[name]), w) for r, w in zip(rows, weights, strict=True)
              if not math.isnan(float(r[name]))]
    return sum(v * w for v, w in values) / total if values else math.nan


def write_json(summary: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return path
