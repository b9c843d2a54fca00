"""End-to-end worker steps/s against the compute ceiling (paper CNN, batch 64).

The ceiling is a plain single-process training loop (forward, backward, momentum-SGD step,
one torch thread, the workers' niceness) measured twice in the same run, before and after
the system runs, times the number of cores. The system is Redis + the GEM aggregator + n
workers; its rate is the gradients published per second over a window, once every worker
is up.
Target: >= 0.7 of the ceiling once n >= 2.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from benchmarks.perf.common import SPAWN, Budget, private_redis, rate_over, ratio
from benchmarks.perf.system import counter, finish, launch
from gemq.config import RunConfig
from gemq.local import LOCAL_WORKER_NICENESS

NAME = "compute"
BATCH = 64


def plain_loop(seconds: float, batch: int, threads: int, out: Any) -> None:
    """Steps/s of the simplest training loop there is, after a warm-up."""
    import torch

    from gemq.data import load_dataset, minibatches
    from gemq.models import PaperCNN

    torch.set_num_threads(threads)
    os.nice(LOCAL_WORKER_NICENESS)  # the workers' priority: both compete alike for the cores
    data = load_dataset("mnist5k")
    model = PaperCNN()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = minibatches(data.train, batch, seed=0)

    def step() -> None:
        x, y = next(batches)
        optimiser.zero_grad(set_to_none=True)
        torch.nn.functional.nll_loss(model(x), y).backward()
        optimiser.step()

    for _ in range(10):
        step()
    steps, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        step()
        steps += 1
    out.put(steps / (time.monotonic() - t0))


def one_core_rate(seconds: float, batch: int = BATCH, threads: int = 1) -> float:
    queue = SPAWN.Queue()
    process = SPAWN.Process(target=plain_loop, args=(seconds, batch, threads, queue))
    process.start()
    rate = float(queue.get(timeout=300))
    process.join()
    return rate


def system_rate(n: int, window_s: float) -> dict[str, Any]:
    config = RunConfig(run_id=f"bench-compute-n{n}", batch_size=BATCH, budget_updates=10**9)
    with private_redis() as (server, client):
        system = launch(server.url, client, config, n)
        try:
            time.sleep(min(2.0, window_s / 2))  # let the first parameter reads settle
            t0, applied0 = time.monotonic(), counter(system.store, "applied")
            steps = rate_over(lambda: counter(system.store, "published"), window_s)
            applied = (counter(system.store, "applied") - applied0) / (time.monotonic() - t0)
            rows = system.store.latest_metrics(50)
        finally:
            finish(system)
    staleness = [float(r["staleness_mean"]) for _, r in rows if int(r["applied"])]
    return {"worker_steps_per_s": round(steps, 2), "updates_per_s": round(applied, 2),
            "mean_staleness": round(statistics.fmean(staleness), 2) if staleness else None}


def run(budget: Budget) -> dict[str, Any]:
    ns = budget.pick((1, 2, 4, 8), (2,))
    window_s = budget.seconds(10.0, 2.0)
    cores = os.cpu_count() or 1
    before = one_core_rate(window_s)
    systems = {f"n{n}": system_rate(n, window_s) for n in ns}
    after = one_core_rate(window_s)
    ceiling = statistics.fmean([before, after]) * cores
    return {
        "compute_ratio": {key: ratio(s["worker_steps_per_s"], ceiling)
                          for key, s in systems.items()},
        "ceiling": {"one_core_steps_per_s_before": round(before, 2),
                    "one_core_steps_per_s_after": round(after, 2), "cores": cores,
                    "steps_per_s": round(ceiling, 2)},
        "runs": systems,
    }
