"""Where the time goes: pyinstrument over the aggregator's or a worker's own loop.

    python -m benchmarks.perf.profile aggregator --size cnn [--seconds 8] [--html out.html]
    python -m benchmarks.perf.profile worker [--workers 2]

``aggregator``: the real Aggregator runs in this process (under the profiler) while the
transport benchmark's producers keep the stream full. ``worker``: one real Worker runs in
this process under the profiler, next to an aggregator process and ``--workers - 1`` other
worker processes. Not part of the suite: a profiler slows what it watches, so no figure
here is a measurement; only the split of the time is.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from pyinstrument import Profiler

from benchmarks.perf import transport
from benchmarks.perf.common import private_redis, start, stop, wait_for
from benchmarks.perf.system import worker_groups
from gemq.aggregation.aggregator import Aggregator, aggregator_main
from gemq.config import RunConfig
from gemq.state.store import RunStore


def profile_aggregator(size_name: str, seconds: float, dtype: str) -> Profiler:
    sizing = transport.Sizing.for_size(transport.SIZES[size_name])
    run_id = f"profile-{size_name}"
    with private_redis() as (server, client):
        layout = transport.layout_for(size_name, sizing.size)
        config = RunConfig(run_id=run_id, budget_updates=10**9, max_pending=sizing.max_pending,
                           read_batch=sizing.read_batch, history=sizing.history,
                           wire_dtype=dtype)
        store = RunStore(client, run_id)
        store.create(config, layout, np.zeros(layout.size, np.float32))
        producers = [start(transport.produce, server.url, run_id, layout.layout_id,
                           f"producer-{i}", layout.size, dtype, sizing.max_pending, i,
                           name=f"producer-{i}") for i in range(transport.PRODUCERS)]
        try:
            wait_for(lambda: client.xlen(store.keys.gradients) >= sizing.max_pending // 2,
                     60, "the producers")
            return _profiled(lambda event: Aggregator(store).run(event), seconds)
        finally:
            stop(producers)


def profile_worker(workers: int, seconds: float) -> Profiler:
    from gemq.running.runs import create_run
    from gemq.training.data import load_dataset
    from gemq.training.worker import Worker, worker_main

    run_id = "profile-worker"
    with private_redis() as (server, client):
        config = RunConfig(run_id=run_id, budget_updates=10**9)
        store = create_run(client, config)
        others = [start(worker_main, server.url, run_id, ids, "cpu", 5, name=f"worker-{i}")
                  for i, ids in enumerate(worker_groups(run_id, workers)[1:])]
        aggregator = start(aggregator_main, server.url, run_id, 5000, name="aggregator")
        try:
            import torch

            torch.set_num_threads(1)
            worker = Worker(store, f"{run_id}-w0", config, load_dataset(config.dataset))
            wait_for(lambda: store.state() == "running", 60, "the aggregator")
            return _profiled(worker.run, seconds)
        finally:
            store.request_stop()
            stop([aggregator, *others])


def _profiled(loop: object, seconds: float) -> Profiler:
    shutdown = threading.Event()
    timer = threading.Timer(seconds, shutdown.set)
    profiler = Profiler(interval=0.001)
    timer.start()
    profiler.start()
    t0 = time.monotonic()
    loop(shutdown)  # type: ignore[operator]
    profiler.stop()
    print(f"profiled {time.monotonic() - t0:.1f}s")
    return profiler


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf.profile")
    parser.add_argument("target", choices=("aggregator", "worker"))
    parser.add_argument("--size", choices=tuple(transport.SIZES), default="cnn")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        default="float32")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--html", help="also write pyinstrument's HTML report here")
    args = parser.parse_args()
    if args.target == "aggregator":
        profiler = profile_aggregator(args.size, args.seconds, args.dtype)
    else:
        profiler = profile_worker(args.workers, args.seconds)
    print(profiler.output_text(unicode=False, color=False, show_all=False))
    if args.html:
        with open(args.html, "w") as f:
            f.write(profiler.output_html())


if __name__ == "__main__":
    main()
