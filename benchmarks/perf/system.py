"""The whole gemq system on this machine: private Redis, one aggregator, n worker processes.

Started the way ``gemq run`` starts it (the same entry points, the same niceness, logical
workers dealt over at most max(4, cores) processes), except that the clock starts only once
every worker process is up: the workers wait while the run is ``created``, and the
aggregator is started when all of them have sent a heartbeat. Process start-up (importing
torch, loading the data) is therefore outside every measured window, for every contender.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import redis

from benchmarks.perf.common import start, stop, wait_for
from gemq.aggregation.aggregator import aggregator_main
from gemq.config import RunConfig
from gemq.running.local import LOCAL_WORKER_NICENESS
from gemq.running.runs import create_run
from gemq.state.store import ENDED, RunState, RunStore
from gemq.training.worker import worker_main


@dataclass
class System:
    store: RunStore
    config: RunConfig
    aggregator: BaseProcess
    workers: list[BaseProcess]
    started: float  # time.monotonic() when the aggregator began leading

    @property
    def pids(self) -> dict[str, int]:
        pids = {"aggregator": self.aggregator.pid or 0}
        pids.update({f"worker_process_{i}": w.pid or 0 for i, w in enumerate(self.workers)})
        return pids


def worker_groups(run_id: str, workers: int, processes: int = 0) -> list[list[str]]:
    """Logical worker ids dealt round-robin, as gemq.running.local does."""
    ids = [f"{run_id}-w{i}" for i in range(workers)]
    processes = processes or min(workers, max(4, os.cpu_count() or 1))
    return [ids[i::processes] for i in range(min(processes, len(ids)))]


def launch(url: str, client: redis.Redis, config: RunConfig, workers: int,
           processes: int = 0) -> System:
    store = create_run(client, config)
    groups = worker_groups(config.run_id, workers, processes)
    children = [start(worker_main, url, config.run_id, ids, "cpu", LOCAL_WORKER_NICENESS,
                      name=f"worker-{i}") for i, ids in enumerate(groups)]
    ids = [w for group in groups for w in group]
    wait_for(lambda: _all_heartbeats(client, store, ids), 180, "every worker to start")
    aggregator = start(aggregator_main, url, config.run_id, 5000, name="aggregator")
    wait_for(lambda: store.state() != "created", 60, "the aggregator to lead")
    return System(store, config, aggregator, children, time.monotonic())


def _all_heartbeats(client: redis.Redis, store: RunStore, ids: list[str]) -> bool:
    pipe = client.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hexists(store.keys.worker(worker_id), "heartbeat_ms")
    return all(pipe.execute())


def finish(system: System, wait_s: float = 0.0) -> None:
    """Wait up to ``wait_s`` for the run to end by itself, then stop it and every process."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and system.store.state() == RunState.RUNNING:
        time.sleep(0.05)
    if system.store.state() not in ENDED:
        system.store.request_stop()
    system.aggregator.join(30)
    stop([system.aggregator, *system.workers])


def counter(store: RunStore, name: str) -> int:
    return int(store.counters().get(name, 0))


@dataclass
class Recorder:
    """Copies of the newest parameters, polled from Redis, with the time since the start."""

    store: RunStore
    started: float
    interval_s: float = 0.2
    snapshots: list[tuple[float, int, np.ndarray]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Recorder:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        last = -1
        while not self._stop.wait(self.interval_s):
            version, params = self.store.latest()
            if version != last:
                self.snapshots.append((time.monotonic() - self.started, version, params.copy()))
                last = version
