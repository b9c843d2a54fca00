"""End-to-end worker steps/s against the compute ceiling (paper CNN, batch 64).

The ceiling is a plain single-process training loop (forward, backward, momentum-SGD step,
one torch thread, the workers' niceness) times the number of cores, measured right before
and right after each system run (the mean of the two): these machines' speed drifts by
tens of percent within minutes. The system is Redis + the GEM aggregator + n
workers; its rate is the gradients published per second over a window, once every worker
is up.
Target: >= 0.7 of the ceiling once n >= 2.

Two options are measured the same way at n = 4: the publication policy (parameters
published after every batch, or at most every 10, 25, 50 ms) with its effect on staleness,
and bfloat16 wire payloads.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from benchmarks.perf.common import SPAWN, Budget, private_redis, rate_over, ratio
from benchmarks.perf.system import counter, finish, launch
from gemq.config import RunConfig
from gemq.running.local import LOCAL_WORKER_NICENESS

NAME = "compute"
BATCH = 64
#: The worker count the options are compared at.
OPTIONS_N = 4
#: publish_interval_ms values of the publication-policy sweep (0: after every batch).
INTERVALS_MS = (0, 10, 25, 50)


def plain_loop(seconds: float, batch: int, threads: int, out: Any, model_spec: str = "cnn",
               loss_spec: str = "nll") -> None:
    """Steps/s of the simplest training loop there is, after a warm-up (``model_spec``,
    ``loss_spec``: as a run's model and loss settings)."""
    import torch

    from gemq.training.data import load_dataset, minibatches
    from gemq.training.losses import load_loss
    from gemq.training.models import build_model

    torch.set_num_threads(threads)
    os.nice(LOCAL_WORKER_NICENESS)  # the workers' priority: both compete alike for the cores
    data = load_dataset("mnist5k")
    model = build_model(model_spec, data.in_features, data.num_classes)
    loss = load_loss(loss_spec)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = minibatches(data.train, batch, seed=0)

    def step() -> None:
        x, y = next(batches)
        optimiser.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        optimiser.step()

    for _ in range(10):
        step()
    steps, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        step()
        steps += 1
    out.put(steps / (time.monotonic() - t0))


def one_core_rate(seconds: float, batch: int = BATCH, threads: int = 1,
                  model_spec: str = "cnn", loss_spec: str = "nll") -> float:
    queue = SPAWN.Queue()
    process = SPAWN.Process(target=plain_loop,
                            args=(seconds, batch, threads, queue, model_spec, loss_spec))
    process.start()
    rate = float(queue.get(timeout=300))
    process.join()
    return rate


def system_rate(n: int, window_s: float, **settings: Any) -> dict[str, Any]:
    config = RunConfig(run_id=f"bench-compute-n{n}", batch_size=BATCH, budget_updates=10**9,
                       **settings)
    with private_redis() as (server, client):
        system = launch(server.url, client, config, n)
        try:
            time.sleep(min(2.0, window_s / 2))  # let the first parameter reads settle
            t0, applied0 = time.monotonic(), counter(system.store, "applied")
            steps = rate_over(lambda: counter(system.store, "published"), window_s,
                              at_least=n)
            applied = (counter(system.store, "applied") - applied0) / (time.monotonic() - t0)
            rows = system.store.latest_metrics(50)
        finally:
            finish(system)
    staleness = [float(r["staleness_mean"]) for _, r in rows if int(r["applied"])]
    return {"worker_steps_per_s": round(steps, 2), "updates_per_s": round(applied, 2),
            "mean_staleness": round(statistics.fmean(staleness), 2) if staleness else None}


def run(budget: Budget) -> dict[str, Any]:
    n_options = budget.pick(OPTIONS_N, 2)
    configs: dict[str, tuple[int, dict[str, Any]]] = {
        f"n{n}": (n, {}) for n in budget.pick((1, 2, 4, 8), (2,))}
    configs.update({f"n{n_options}_{_policy_name(ms)}": (n_options, {"publish_interval_ms": ms})
                    for ms in budget.pick(INTERVALS_MS, (0, 25))})
    configs[f"n{n_options}_bf16"] = (n_options, {"wire_dtype": "bfloat16"})
    window_s = budget.seconds(10.0, 2.0)
    plain_s = budget.seconds(5.0, 1.0)
    cores = os.cpu_count() or 1
    # The machine's speed drifts by tens of percent over minutes (other tenants): each
    # system run is judged against plain-loop runs made right before and right after it.
    plain = [one_core_rate(plain_s)]
    runs: dict[str, dict[str, Any]] = {}
    for name, (n, settings) in configs.items():
        runs[name] = system_rate(n, window_s, **settings)
        if not budget.quick:  # --quick: the one plain run before serves every system run
            plain.append(one_core_rate(plain_s))
        ceiling = statistics.fmean(plain[-2:]) * cores
        runs[name]["ceiling_steps_per_s"] = round(ceiling, 2)
        runs[name]["compute_ratio"] = ratio(runs[name]["worker_steps_per_s"], ceiling)
    return {
        "compute_ratio": {name: runs[name]["compute_ratio"]
                          for name, (_, settings) in configs.items() if not settings},
        "publication_policy": {f"n{n_options}": {
            name.removeprefix(f"n{n_options}_"): {
                "compute_ratio": run["compute_ratio"],
                "mean_staleness": run["mean_staleness"]}
            for name, run in runs.items() if "publish_interval_ms" in configs[name][1]}},
        "compute_ratio_bf16": {f"n{n_options}": runs[f"n{n_options}_bf16"]["compute_ratio"]},
        "ceiling": {"one_core_steps_per_s": [round(r, 2) for r in plain], "cores": cores},
        "runs": runs,
    }


def _policy_name(interval_ms: int) -> str:
    return f"every_{interval_ms}ms" if interval_ms else "every_batch"
