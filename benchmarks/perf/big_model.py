"""End to end, a model brought as a ``module:factory`` spec that is too big for one core's
comfort: the 784-3000-3000-10 MLP (11.4 M parameters, benchmarks/big_models.py), 2 workers,
through ``gemq run`` exactly as a user types it, against one core's plain training loop of
the same model and batch size.

The runs: ``auto``, no flag at all (what gemq chooses for the model and the machine:
gemq/running/sizing.py); then with the settings worked out by hand (``advised``:
``--max-pending 4``, a snapshot budget for 7 versions, bfloat16 gradients on the wire and
new parameters every second update): ``--shards 1``; ``--shards 2`` (two aggregators, one
private Redis); ``--shards 2 --local-cluster 2`` (two aggregators, a private Redis Cluster
of two masters; the run id is chosen so that the two shards fall on different masters);
the same with an empty ``MALLOC_CONF`` in its environment, which its Redis servers inherit
(their allocator then hands every freed value back to the kernel, as before gemq's private
Redis kept freed pages: sharded.RELEASE_PAGES); ``--shards 1`` with float32 gradients and
new parameters after every update (the advice before the last two settings); and the
values gemq uses for small models (64 in flight, 64 MB of snapshots, float32, every
update), to show what they cost a big one.

The rate of a run is taken from its own curves (``metrics.csv``: a row per commit of
shard 0, with its wall time and updates) between 20% of its updates and its last row, so
start-up (importing torch, loading the data, spawning processes) and the final evaluation
are outside it. The plain loop (forward, backward, momentum-SGD step; one torch thread,
the workers' niceness) runs right before and right after each run; the ratio uses the
mean of the two.

``big_model_ratio.*``: a run's updates/s over the plain loop's steps/s. Target >= 0.6.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.big_models import MLP_11M, mlp_shapes
from benchmarks.perf.common import Budget, ratio
from benchmarks.perf.compute import one_core_rate
from benchmarks.perf.sharded import RELEASE_PAGES, spread_run_id
from gemq.layout import ParamLayout

NAME = "big_model"
MODEL = "benchmarks.big_models:mlp_11m"
LOSS = "cross_entropy"  # the factory's MLP outputs logits
BATCH = 64
WORKERS = 2
ROOT = Path(__file__).resolve().parents[2]
#: The README's advice for big models: few gradients in flight (workers wait instead of
#: queueing stale gradients), and snapshots for as many versions as a gradient can be
#: stale then (max_pending + workers, and one more). With the defaults (64 in flight,
#: 64 MB of snapshots: two of this model's 43 MB), most gradients are rejected as
#: snapshot_gone.
MAX_PENDING = 4
#: ...and half the bytes: gradients in bfloat16 (converted in the workers, widened by the
#: aggregators), parameters published (and read by every worker) every second update.
FEWER_BYTES = ["--wire-dtype", "bfloat16", "--publish-every", "2"]


def advised(shards: int, fewer_bytes: bool = True) -> list[str]:
    """The README's flags for this model in ``shards`` shards."""
    model_mb = 4 * ParamLayout.from_shapes(mlp_shapes(*MLP_11M)).size / 2**20
    budget = math.ceil((MAX_PENDING + WORKERS + 1) * model_mb / shards / 32) * 32
    return ["--shards", str(shards), "--max-pending", str(MAX_PENDING),
            "--snapshot-budget-mb", str(budget), *(FEWER_BYTES if fewer_bytes else [])]


#: The values gemq used for every model before it sized runs itself (and still chooses for
#: small ones): to show what they cost a big model.
SMALL_MODEL_VALUES = ["--shards", "1", "--max-pending", "64", "--snapshot-budget-mb", "64",
                      "--wire-dtype", "float32", "--publish-every", "1"]
#: name -> the flags that make the run
RUNS = {"auto": [],  # no flag: what gemq chooses (gemq/running/sizing.py)
        "s1": advised(1), "s2": advised(2),
        "s2_local_cluster": [*advised(2), "--local-cluster", "2"],
        "s2_local_cluster_release_pages": [*advised(2), "--local-cluster", "2"],
        "s1_float32": advised(1, fewer_bytes=False),
        "s1_small_model_values": SMALL_MODEL_VALUES}
#: name -> environment variables of the run (its private Redis servers inherit them)
ENVIRONMENT = {"s2_local_cluster_release_pages": {"MALLOC_CONF": RELEASE_PAGES}}
#: The share of a run's updates left out of its rate: the start, while the workers still load.
SKIP = 0.2


def run(budget: Budget) -> dict[str, Any]:
    steps = budget.pick(120, 12)
    plain_s = budget.seconds(5.0, 1.0)
    names = budget.pick(list(RUNS), ["auto"])
    plain = [one_core_rate(plain_s, BATCH, 1, MODEL, LOSS)]
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        runs[name] = gemq_run(name, steps)
        if not budget.quick:  # --quick: the one plain run before serves the run
            plain.append(one_core_rate(plain_s, BATCH, 1, MODEL, LOSS))
        runs[name]["plain_steps_per_s"] = round(statistics.fmean(plain[-2:]), 3)
        runs[name]["ratio"] = ratio(runs[name]["updates_per_s"],
                                    runs[name]["plain_steps_per_s"])
    return {"big_model_ratio": {name: r["ratio"] for name, r in runs.items()},
            "plain_steps_per_s": [round(p, 3) for p in plain], "runs": runs}


def gemq_run(name: str, steps: int) -> dict[str, Any]:
    """``gemq run`` of the model with the flags of ``RUNS[name]``; its steady rate."""
    run_id = spread_run_id(f"bench-big-{name.replace('_', '-')}", 2, 2)
    with tempfile.TemporaryDirectory(prefix="gemq-big-model-") as out:
        command = [sys.executable, "-m", "gemq", "run", "--model", MODEL, "--dataset",
                   "mnist5k", "--batch-size", str(BATCH), "--workers", str(WORKERS),
                   "--steps", str(steps), "--run", run_id, "--out", out, "--no-progress",
                   "--json", f"{out}/summary.json",
                   "--accept-poor-result",  # a speed measurement: --quick's 12 updates learn little
                   *RUNS[name]]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env={**os.environ, **ENVIRONMENT.get(name, {})})
        if done.returncode != 0:
            raise RuntimeError(f"benchmark: gemq run {' '.join(RUNS[name])} failed: "
                               f"{done.stderr.strip()[-2000:]}")
        summary = json.loads(Path(out, "summary.json").read_text())
        with Path(out, "metrics.csv").open(newline="") as curves:
            rows = list(csv.DictReader(curves))
    flags = " ".join([*(f"{k}={v}" for k, v in ENVIRONMENT.get(name, {}).items()),
                      *RUNS[name]])
    return {"flags": flags, "updates": summary["updates_applied"],
            "updates_per_s": steady_rate(rows, steps),
            "wall_updates_per_s": summary["updates_per_s"],  # start-up and evaluation in
            "wall_time_s": summary["wall_time_s"],
            "test_accuracy": summary["test_accuracy"],
            "staleness_mean": summary["staleness_mean"],
            "rejected": summary["rejected"]}


def steady_rate(rows: list[dict[str, str]], steps: int) -> float:
    """Updates/s from the first row past SKIP of the budget to the last row."""
    points = [(int(r["t_ms"]), int(r["updates"])) for r in rows]
    first = next(p for p in points if p[1] >= SKIP * steps)
    last = points[-1]
    return round((last[1] - first[1]) / max((last[0] - first[0]) / 1000, 1e-3), 3)
