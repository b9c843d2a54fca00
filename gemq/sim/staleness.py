"""Staleness models of the simulator: in which order n workers' gradients reach the aggregator.

Each worker repeats: read theta, compute for a while, commit (the commit is instantaneous: the
simulated aggregator is never the bottleneck), read theta again. The only thing a model
decides is how long each computation takes, in arbitrary time units:

- ``round-robin``: every computation takes 1. Ties go to the lower worker index, so workers
  commit in the fixed order 0, 1, ..., n-1, 0, 1, ... and every update after the first n is
  exactly n-1 updates stale (the expected staleness of the paper's homogeneous FIFO queue).
- ``random``: durations drawn from a gamma distribution with mean 1 and coefficient of
  variation ``time_cv`` (1 is exponential); staleness varies around n-1.
- ``heterogeneous``: the first ``round(slow_fraction * n)`` workers take ``slow_factor``
  times longer; with ``time_cv > 0`` every duration is also drawn as in ``random``.

Scheduling is a heap of (finish time, worker index): O(log n) per commit, whatever n is.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from gemq.errors import ConfigError

STALENESS_KINDS = ("round-robin", "random", "heterogeneous")


@dataclass(frozen=True)
class StalenessModel:
    kind: str = "round-robin"
    #: Coefficient of variation of a computation's duration (random, heterogeneous).
    time_cv: float = 0.5
    #: Share of the workers that are slow (heterogeneous).
    slow_fraction: float = 0.25
    #: How many times longer a slow worker's computation takes (heterogeneous).
    slow_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_KINDS:
            raise ConfigError("staleness", f"must be one of {', '.join(STALENESS_KINDS)}; "
                                           f"got {self.kind!r}")
        _check("time_cv", self.time_cv, 0.0, 10.0)
        _check("slow_fraction", self.slow_fraction, 0.0, 1.0)
        _check("slow_factor", self.slow_factor, 1.0, 1e6)

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "time_cv": self.time_cv,
                "slow_fraction": self.slow_fraction, "slow_factor": self.slow_factor}


def _check(name: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(name, f"must be in [{low:g}, {high:g}], got {value:g}")


class Schedule:
    """The commit order of ``workers`` workers under ``model``, reproducible from ``seed``."""

    def __init__(self, model: StalenessModel, workers: int, seed: int) -> None:
        if workers < 1:
            raise ConfigError("workers", f"must be at least 1, got {workers}")
        self.model = model
        self.now = 0.0
        self._rng = np.random.default_rng([seed, 0x57A1E])  # a stream of its own
        self._factor = self._slowness(workers)
        self._heap: list[tuple[float, int]] = []
        for worker in range(workers):
            self.start(worker)

    def _slowness(self, workers: int) -> np.ndarray:
        factor = np.ones(workers)
        if self.model.kind == "heterogeneous":
            factor[:round(self.model.slow_fraction * workers)] = self.model.slow_factor
        return factor

    def _duration(self, worker: int) -> float:
        base = float(self._factor[worker])
        cv = self.model.time_cv
        if self.model.kind == "round-robin" or cv == 0.0:
            return base
        shape = 1.0 / cv**2  # gamma(k, 1/k) has mean 1 and coefficient of variation 1/sqrt(k)
        return base * float(self._rng.gamma(shape, 1.0 / shape))

    def start(self, worker: int) -> None:
        """``worker`` has just read theta and starts computing a gradient."""
        heapq.heappush(self._heap, (self.now + self._duration(worker), worker))

    def next(self) -> int:
        """The worker whose gradient lands next; the clock moves to its commit."""
        self.now, worker = heapq.heappop(self._heap)
        return worker
