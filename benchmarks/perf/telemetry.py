"""What the timing hooks cost the loops they time (gemq.telemetry; docs/performance.md).

- ``worker_*``: the worker's hook (three clock reads and two observer calls per step) over
  the step it times: the paper CNN's gradient on a batch of 64 and its encoding, one torch
  thread. ``silent``: the library's default observer; ``prometheus``: the worker service's
  histograms and counters, in memory.
- ``smallest_model_worker_prometheus``: the same over the smallest built-in model's step
  (logreg on digits, batch 16): the worst case.
- ``aggregator_prometheus``: the aggregator's hook (three clock reads and two observer
  calls per batch) with the aggregator service's histograms in prometheus_client's
  multiprocess mode (values in files, as the service runs them), in a process of its own,
  over the GEM update of one CNN gradient: the smallest batch there is.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks.perf.common import SPAWN, Budget

NAME = "telemetry"
CNN_BATCH, LOGREG_BATCH = 64, 16


def step_seconds(model: str, dataset: str, batch: int, steps: int) -> tuple[float, int]:
    """Seconds per worker step (gradient and encoding) after a warm-up, and message bytes."""
    import torch

    from gemq.training.data import load_dataset, minibatches
    from gemq.training.flatmodel import FlatModel
    from gemq.training.models import build_model, layout_of
    from gemq.wire import codec

    torch.set_num_threads(1)
    data = load_dataset(dataset)
    model_ = build_model(model, data.in_features, data.num_classes)
    layout_id, net = layout_of(model_).layout_id, FlatModel(model_)
    batches = minibatches(data.train, batch, seed=0)

    def step() -> bytes:
        result = net.gradient(*next(batches))
        return codec.encode(run_id="bench", worker_id="w0", param_version=0, samples=batch,
                            loss=result.loss, accuracy=result.accuracy, layout_id=layout_id,
                            gradient=result.output)

    for _ in range(3):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        message = step()
    return (time.perf_counter() - started) / steps, len(message)


def worker_hook_seconds(observer: Any, message_bytes: int, rounds: int) -> float:
    """Seconds per step that gemq/training/worker.py's hook adds, statement for statement."""
    clock = time.perf_counter
    begun = clock()
    for _ in range(rounds):
        started = clock()
        computed = clock()
        observer.step_computed(computed - started)
        observer.gradient_published(message_bytes, clock() - computed)
    return (clock() - begun) / rounds


def aggregator_hook_seconds(rounds: int, out: Any) -> None:
    """In a fresh process: seconds per batch of gemq/aggregation/aggregator.py's hook, with the
    aggregator service's observer in multiprocess mode."""
    with tempfile.TemporaryDirectory() as directory:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # before prometheus_client loads
        from gemq.services.telemetry import PrometheusAggregator

        observer = PrometheusAggregator()
        begun = time.perf_counter()
        for _ in range(rounds):
            started = time.perf_counter()
            observer.batch_applied(1, time.perf_counter() - started)
            observer.window_committed(1, time.monotonic() - started)
        out.put((time.perf_counter() - begun) / rounds)


def apply_seconds(size: int, rounds: int) -> float:
    """Seconds per GEM update of ``size`` parameters (one gradient, one worker)."""
    import numpy as np

    from gemq.aggregation.rules import make_rule
    from gemq.config import RunConfig

    rule = make_rule(RunConfig(run_id="bench"), size)
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(size).astype(np.float32)
    gradient = rng.standard_normal(size).astype(np.float32) * 1e-3
    snapshot = theta.copy()
    for _ in range(3):
        rule.apply(theta, gradient, snapshot, "w0", 1)
    started = time.perf_counter()
    for _ in range(rounds):
        rule.apply(theta, gradient, snapshot, "w0", 1)
    return (time.perf_counter() - started) / rounds


def share(part: float, whole: float) -> float:
    """part / whole to three significant digits (a ratio rounded to 4 places would read 0)."""
    return float(f"{part / whole:.3g}")


def _in_child(rounds: int) -> float:
    queue = SPAWN.Queue()
    child = SPAWN.Process(target=aggregator_hook_seconds, args=(rounds, queue))
    child.start()
    seconds = float(queue.get(timeout=120))
    child.join(30)
    return seconds


def run(budget: Budget) -> dict[str, Any]:
    from gemq.services.telemetry import PrometheusWorker
    from gemq.telemetry import SILENT_WORKER

    steps, hooks = budget.pick(40, 3), budget.pick(200_000, 2_000)
    cnn, cnn_bytes = step_seconds("cnn", "mnist5k", CNN_BATCH, steps)
    logreg, _ = step_seconds("logreg", "digits", LOGREG_BATCH, steps * 10)
    cnn_size = (cnn_bytes - 64) // 4  # float32 values; the header is under 64 bytes
    prometheus = PrometheusWorker()
    # Alternating rounds: the machine's drift hits both alike.
    silent_s = statistics.median(worker_hook_seconds(SILENT_WORKER, cnn_bytes, hooks)
                                 for _ in range(3))
    worker_s = statistics.median(worker_hook_seconds(prometheus, cnn_bytes, hooks)
                                 for _ in range(3))
    aggregator_s = _in_child(hooks)
    apply_s = apply_seconds(cnn_size, budget.pick(200, 10))
    return {
        "telemetry_overhead": {
            "worker_silent": share(silent_s, cnn),
            "worker_prometheus": share(worker_s, cnn),
            "smallest_model_worker_prometheus": share(worker_s, logreg),
            "aggregator_prometheus": share(aggregator_s, apply_s)},
        "hook_us": {"worker_silent": round(1e6 * silent_s, 3),
                    "worker_prometheus": round(1e6 * worker_s, 3),
                    "aggregator_prometheus_multiprocess": round(1e6 * aggregator_s, 3)},
        "step_ms": {"worker_cnn": round(1000 * cnn, 3), "worker_logreg": round(1000 * logreg, 3),
                    "aggregator_apply_cnn": round(1000 * apply_s, 3)},
    }
