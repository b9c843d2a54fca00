"""The aggregator's commit window: what the gradients read since the last commit did (their
updates, counters and workers' changes), and the CommitPlan it becomes, all committed in
one atomic step (gemq/aggregation/leadership.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gemq.aggregation.rules import UpdateStats
from gemq.aggregation.tally import UpdateTally
from gemq.state.store import now_ms
from gemq.wire import codec

#: The pseudo-worker that rejections from unregistered or invalid senders are counted
#: under (not a valid worker id, so no worker can take its name).
UNKNOWN_WORKER = "~unknown"
#: worker id -> (fields to set, fields to increment) in the worker's hash.
WorkerChanges = dict[str, tuple[dict[str, Any], dict[str, int]]]


@dataclass
class CommitWindow:
    """What the open window did: its updates, its counters and its workers' changes, all
    committed in one atomic step when the window closes."""

    tally: UpdateTally = field(default_factory=UpdateTally)
    counters: dict[str, int] = field(default_factory=dict)
    workers: WorkerChanges = field(default_factory=dict)

    @property
    def applied(self) -> int:
        return self.tally.updates

    def _worker(self, worker_id: str) -> tuple[dict[str, Any], dict[str, int]]:
        return self.workers.setdefault(worker_id, ({}, {}))

    def count(self, name: str, worker_id: str | None = None) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1
        if worker_id is not None:
            incr = self._worker(worker_id)[1]
            incr[name] = incr.get(name, 0) + 1

    def applied_update(self, msg: codec.GradientMessage, stats: UpdateStats) -> None:
        self.tally.add(stats, msg.loss, msg.samples, accuracy=msg.accuracy)
        self.count("applied", msg.worker_id)
        fields, incr = self._worker(msg.worker_id)
        fields.update(last_staleness=stats.staleness, last_update_ms=now_ms(),
                      last_loss=f"{msg.loss:.6g}")
        incr["staleness_sum"] = incr.get("staleness_sum", 0) + stats.staleness

    def metrics(self, updates: int, active_workers: int,
                pi_tensors: list[float | None] | None) -> dict[str, object]:
        means = self.tally.means()
        row: dict[str, object] = {
            "t_ms": now_ms(), "updates": updates, "applied": self.applied,
            "rejected": sum(v for k, v in self.counters.items() if k.startswith("rejected:")),
            "loss": f"{means['loss']:.6g}", "energy_ratio": f"{means['energy_ratio']:.6g}",
            "accuracy": f"{means['accuracy']:.6g}",  # nan: no gradient of the window had one
            "median_pi": f"{means['median_pi']:.6g}",
            # The window's sums, so that a sharded run's ratio is summed over its shards.
            "e_central": f"{self.tally.e_central:.6g}", "e_proxy": f"{self.tally.e_proxy:.6g}",
            "staleness_mean": f"{means['staleness_mean']:.4g}",
            "staleness_max": self.tally.staleness_max, "active_workers": active_workers,
        }
        if pi_tensors is not None:
            row["pi_tensors"] = json.dumps([None if p is None else round(p, 5)
                                            for p in pi_tensors])
        return row


@dataclass
class CommitPlan:
    """Everything one aggregator window writes, in one atomic step: what a CommitWindow did,
    with where the stream and the versions stand (gemq/aggregation/leadership.py commits
    it)."""

    version: int
    updates: int
    #: The head's last applied id before this window, and after it.
    prev_id: str
    last_id: str
    ack: list[str]
    publish: bool = True
    drop: list[int] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    workers: WorkerChanges = field(default_factory=dict)
    #: The shard's final state, set in its head with this commit (state, ended_ms, error).
    final: dict[str, Any] = field(default_factory=dict)
    #: GEM moments checkpointed with this commit (by worker id), and checkpoints dropped.
    checkpoint: dict[str, np.ndarray] = field(default_factory=dict)
    forget: list[str] = field(default_factory=list)
