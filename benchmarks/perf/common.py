"""What every benchmark shares: private Redis, child processes, sampling, result shape."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import psutil
import redis

from gemq.running.embedded import EmbeddedRedis

SPAWN = mp.get_context("spawn")  # children start clean: no inherited torch threads or locks
MB = 1024 * 1024


@dataclass(frozen=True)
class Budget:
    """How long each measurement runs; --quick shrinks everything to a smoke test."""

    quick: bool

    def seconds(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full


def machine() -> dict[str, Any]:
    """The machine a run came from, and how busy it was when the run started."""
    import numpy as np
    import torch

    load1, load5, load15 = os.getloadavg()
    return {"platform": platform.platform(), "processor": platform.processor() or "unknown",
            "cpu_count": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "redis_py": redis.__version__,
            "load_average_at_start": [round(load1, 2), round(load5, 2), round(load15, 2)]}


@contextlib.contextmanager
def private_redis() -> Iterator[tuple[EmbeddedRedis, redis.Redis]]:
    """A redis-server of our own on a free port (never the machine's 6379), and a client."""
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        try:
            yield server, client
        finally:
            client.close()


def start(target: Callable[..., Any], *args: Any, name: str) -> BaseProcess:
    process = SPAWN.Process(target=target, args=args, name=name, daemon=True)
    process.start()
    return process


def stop(processes: list[BaseProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM the ones still alive, then SIGKILL whoever has not left in time."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark: timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the result is not finite."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    value = numerator / denominator
    return round(value, 4) if math.isfinite(value) else None


@dataclass
class Peaks:
    """Peak RSS per labelled process, sampled from a thread while a run goes on."""

    pids: dict[str, int]
    interval_s: float = 0.2
    rss: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Callable[[], float]] = field(default_factory=dict)
    peak_extra: dict[str, float] = field(default_factory=dict)
    series: list[dict[str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Peaks:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        row: dict[str, float] = {"t": time.monotonic()}
        for label, pid in self.pids.items():
            with contextlib.suppress(psutil.Error):
                rss = psutil.Process(pid).memory_info().rss
                self.rss[label] = max(self.rss.get(label, 0), rss)
                row[label] = rss
        for label, read in self.extra.items():
            with contextlib.suppress(redis.RedisError):
                value = float(read())
                self.peak_extra[label] = max(self.peak_extra.get(label, value), value)
                row[label] = value
        self.series.append(row)


#: The longest a window waits for its first events beyond its length (s).
RATE_WAIT_S = 120.0


def rate_over(read: Callable[[], int], seconds: float, at_least: int = 1) -> float:
    """Events per second of a monotone counter over a window of ``seconds``, or longer,
    until it holds ``at_least`` events: on a loaded machine a short window can fall before
    slow processes make their first step, and a rate of 0 would measure only that. A
    counter that stays still for RATE_WAIT_S more is a rate of 0 after all."""
    first, t0 = read(), time.monotonic()
    time.sleep(seconds)
    while read() - first < at_least and time.monotonic() - t0 < seconds + RATE_WAIT_S:
        time.sleep(0.05)
    last, t1 = read(), time.monotonic()
    return (last - first) / (t1 - t0)


def int_or_zero(raw: bytes | None) -> int:
    return int(raw) if raw is not None else 0
