"""python -m benchmarks.perf.shard_plot RESULTS.json OUT.png

Draws the shard_sizes benchmark's points from a ``python -m benchmarks.perf --json`` file:
updates/s against parameters, one shard and the best shard count measured at each size.
Needs matplotlib (``pip install -e '.[paper]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def draw(table: dict[str, dict[str, Any]], machine: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(table.values(), key=lambda row: row["parameters"])
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    one = [(row["parameters"], row["updates_per_s"]["1"]) for row in rows
           if "1" in row["updates_per_s"]]
    best = [(row["parameters"], row["updates_per_s"][str(row["best_shards"])],
             row["best_shards"]) for row in rows]
    axes.plot(*zip(*one, strict=True), "o-", label="1 shard")
    axes.plot([p for p, _, _ in best], [r for _, r, _ in best], "s--",
              label="best shard count measured")
    for parameters, rate, shards in best:
        axes.annotate(f"S={shards}", (parameters, rate), textcoords="offset points",
                      xytext=(4, 6), fontsize=8)
    axes.set(xscale="log", yscale="log", xlabel="parameters (float32)",
             ylabel="updates/s applied by every shard",
             title="gemq transport, GEM, one Redis (measured)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.text(0.01, 0.01, machine, fontsize=7, alpha=0.7)
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    figure.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf.shard_plot",
                                     description=__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    result = json.loads(args.results.read_text())
    detail = result["details"]["shard_sizes"]
    load = detail.get("load_average_at_start", result["machine"].get("load_average_at_start"))
    caption = (f"{result['machine']['cpu_count']} cores shared by every process, load "
               f"average {load} at start, {detail['started']}")
    draw(detail["shard_sizes"], caption, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
