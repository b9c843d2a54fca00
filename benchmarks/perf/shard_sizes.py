"""Transport throughput from 0.16 M to 150 M parameters, with as many shards as it takes.

Each point is a real GEM run of synthetic gradients on one Redis, an aggregator process per
shard, producers at full speed (benchmarks/perf/sharded.py): updates/s applied by every
shard, and the CPU seconds and bytes each process spent per update. One shard holds at most
64 MiB (gemq/shards.py: MAX_SHARD_BYTES), so 40 M parameters need 3 shards and the
150 M-parameter MLP of benchmarks/big_models.py (153.6 M, 614 MB) needs 10.

Past one shard's size, one producer feeds the run instead of two: a producer holds two
copies of the gradient, each aggregator a GEM moment per producer, and at 150 M two
producers would take the run past 11 GB on a machine shared with others.

From the per-process costs, ``projection`` (benchmarks/perf/projection.py) projects the
throughput of S = 1..32 shards with a machine per shard; ``python -m
benchmarks.perf.shard_plot`` draws the measured points.
"""

from __future__ import annotations

from typing import Any

from benchmarks.big_models import MLP_150M, mlp_shapes
from benchmarks.perf.common import Budget, ratio
from benchmarks.perf.projection import project
from benchmarks.perf.sharded import measure
from gemq.layout import ParamLayout
from gemq.shards import MAX_SHARD_BYTES

NAME = "shard_sizes"
LAYOUT_150M = ParamLayout.from_shapes(mlp_shapes(*MLP_150M))
#: label -> (parameters, shard counts measured)
POINTS: dict[str, tuple[int, tuple[int, ...]]] = {
    "0.16m": (163_790, (1, 2)),
    "1m": (1_000_000, (1, 2)),
    "11m": (11_000_000, (1, 2, 4)),
    "40m": (40_000_000, (3,)),
    "150m": (LAYOUT_150M.size, (10,)),
}
QUICK_POINTS = {"0.16m": (163_790, (1, 2))}


def run(budget: Budget) -> dict[str, Any]:
    points = budget.pick(POINTS, QUICK_POINTS)
    runs: dict[str, dict[str, Any]] = {}
    for label, (size, shard_counts) in points.items():
        producers = 2 if 4 * size <= MAX_SHARD_BYTES else 1
        layout = LAYOUT_150M if size == LAYOUT_150M.size else None
        window_s = budget.seconds(6.0 if size < 10**7 else 12.0, 1.0)
        for shards in shard_counts:
            runs[f"{label}_s{shards}"] = measure(size, shards, 0, window_s, producers, layout)
    return summarise(runs)


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Updates/s by size and shard count; the ratio: bytes per second of gradients moved at
    each size (with its best shard count) over the 11 M, one-shard run's."""
    table: dict[str, dict[str, Any]] = {}
    for name, result in runs.items():
        row = table.setdefault(name.rpartition("_s")[0], {"parameters": result["parameters"],
                                                           "updates_per_s": {}})
        row["updates_per_s"][result["shards"]] = result["updates_per_s"]
    for row in table.values():
        rates = row["updates_per_s"]
        row["best_shards"] = max(rates, key=lambda s: rates[s])
        row["bytes_per_s"] = 4 * row["parameters"] * rates[row["best_shards"]]
    reference = table.get("11m", next(iter(table.values())))
    bytes_ratio = {label: ratio(row["bytes_per_s"], 4 * reference["parameters"]
                                * reference["updates_per_s"][1])
                   for label, row in table.items()}
    return {"shard_bytes_rate": bytes_ratio, "shard_sizes": table,
            "projection": project(list(runs.values())), "runs": runs}
