"""What real-model features cost: mixed precision on the worker step, and the aggregator's
checkpoints of the GEM moments.

- ``amp``: the worker step (gemq.training.flatmodel.FlatModel.gradient: forward, backward, flat
  gradient) of the paper CNN and of the residual CNN, batch 64, one torch thread, in float32
  and under bfloat16 autocast, in alternating rounds; the ratio is float32 time over
  bfloat16 time (above 1: autocast is faster).
- ``checkpoint``: the paper CNN with 4 workers, updates/s with the moments checkpointed
  (checkpoint_overhead 0.05, the default) over updates/s without (0), in alternating
  rounds, and how often a checkpoint landed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.perf.common import Budget, private_redis, rate_over, ratio
from benchmarks.perf.system import counter, finish, launch
from gemq.config import RunConfig

NAME = "real_models"
BATCH = 64
MODELS = ("cnn", "resnet")
CHECKPOINT_WORKERS = 4


def step_seconds(model_name: str, amp: str, steps: int) -> float:
    """Seconds per worker step of ``model_name`` with ``amp``, after a warm-up."""
    import torch

    from gemq.training.data import load_dataset, minibatches
    from gemq.training.flatmodel import FlatModel
    from gemq.training.models import build_model

    torch.set_num_threads(1)
    data = load_dataset("mnist5k")
    net = FlatModel(build_model(model_name, 784, 10), amp=amp)
    batches = minibatches(data.train, BATCH, seed=0)
    for _ in range(3):
        net.gradient(*next(batches))
    started = time.perf_counter()
    for _ in range(steps):
        net.gradient(*next(batches))
    return (time.perf_counter() - started) / steps


def amp_cost(budget: Budget) -> dict[str, Any]:
    rounds, steps = budget.pick(3, 1), budget.pick(40, 3)
    result: dict[str, Any] = {}
    for model_name in MODELS:
        times: dict[str, list[float]] = {"off": [], "bfloat16": []}
        for _ in range(rounds):  # A B A B: the machine's drift hits both alike
            for amp in times:
                times[amp].append(step_seconds(model_name, amp, steps))
        off, bf16 = statistics.median(times["off"]), statistics.median(times["bfloat16"])
        result[model_name] = {"step_ms_float32": round(1000 * off, 3),
                              "step_ms_bfloat16": round(1000 * bf16, 3),
                              "float32_over_bfloat16": ratio(off, bf16)}
    return result


def checkpointed_rate(overhead: float, window_s: float, workers: int = CHECKPOINT_WORKERS,
                      settle_s: float = 1.0) -> dict[str, Any]:
    config = RunConfig(run_id="bench-checkpoint", batch_size=BATCH, budget_updates=10**9,
                       checkpoint_overhead=overhead)
    with private_redis() as (server, client):
        system = launch(server.url, client, config, workers)
        try:
            time.sleep(settle_s)
            checkpoints = _checkpoint_versions(system.store, window_s)
            rate = rate_over(lambda: counter(system.store, "applied"), window_s)
        finally:
            finish(system)
    return {"updates_per_s": round(rate, 2), "checkpoints_seen": checkpoints}


def _checkpoint_versions(store: Any, window_s: float) -> int:
    """How many distinct checkpoint versions appear while polling for a short while."""
    seen, deadline = set(), time.monotonic() + min(2.0, window_s)
    while time.monotonic() < deadline:
        seen.add(store.checkpointed_moments()[0])
        time.sleep(0.05)
    return len(seen - {-1})


def checkpoint_cost(budget: Budget) -> dict[str, list[dict[str, Any]]]:
    rounds, window_s = budget.pick(2, 1), budget.seconds(8.0, 2.0)
    workers, settle_s = budget.pick(CHECKPOINT_WORKERS, 2), budget.seconds(1.0, 1.0)
    runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    for _ in range(rounds):
        runs["with"].append(checkpointed_rate(0.05, window_s, workers, settle_s))
        runs["without"].append(checkpointed_rate(0.0, window_s, workers, settle_s))
    return runs


def run(budget: Budget) -> dict[str, Any]:
    amp = amp_cost(budget)
    runs = checkpoint_cost(budget)
    rate = {name: statistics.fmean(r["updates_per_s"] for r in rs) for name, rs in runs.items()}
    return {"amp": {m: amp[m]["float32_over_bfloat16"] for m in MODELS},
            "checkpoint": {"with_over_without": ratio(rate["with"], rate["without"]),
                           "checkpoints_in_2s": statistics.fmean(
                               r["checkpoints_seen"] for r in runs["with"])},
            "amp_steps": amp, "checkpoint_runs": runs}
