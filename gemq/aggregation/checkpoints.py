"""When the aggregator checkpoints the GEM moments into Redis, so that a new leader (after a
crash, a kill, a failover) starts from them instead of from zero.

A checkpoint rides on a commit: the moments are staged beside the parameters and renamed
into place by the same atomic script, so the moments in Redis always belong to one committed
version. Its cost, the wall time of that commit, sets the wait before the next one: at most
``overhead`` of the leader's time goes to checkpoints, whatever the model's size or the
number of workers (tiny models checkpoint every few commits, large ones every few seconds).
"""

from __future__ import annotations

import math
import time

import numpy as np

from gemq.aggregation.rules import Rule


class MomentCheckpoints:
    def __init__(self, overhead: float) -> None:
        self.overhead = overhead
        self._cost_s = 0.0
        self._done_at = -math.inf
        self._forgotten: set[str] = set()

    def due(self) -> bool:
        if self.overhead <= 0:
            return False
        return time.monotonic() - self._done_at >= self._cost_s / self.overhead

    def forgotten(self, worker_id: str) -> None:
        """A worker whose moment the rule dropped: its checkpoint goes with the next one."""
        self._forgotten.add(worker_id)

    def take(self, rule: Rule) -> tuple[dict[str, np.ndarray], list[str]]:
        """(moments to checkpoint, checkpoints to drop). The arrays are the rule's own: the
        commit must be sent before the next update."""
        moments = rule.moments()
        forget = sorted(self._forgotten - set(moments))
        self._forgotten.clear()
        return moments, forget

    def done(self, cost_s: float) -> None:
        self._cost_s, self._done_at = cost_s, time.monotonic()
