"""The end-of-run summary: what was applied, rejected, measured; written as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemq.config import RunConfig
from gemq.records import combine
from gemq.records.curves import CURVES_FILE
from gemq.state.store import RunStore


@dataclass(frozen=True)
class RunSummary:
    """What a local run did: ``gemq.train``'s result. ``summary.json`` holds the same fields
    (``to_dict``; ``from_dict`` reads one back)."""

    run_id: str
    state: str
    #: Gradients: applied, published by workers, rejected (by reason), left unused.
    updates_applied: int
    published: int
    rejected: Mapping[str, int]
    unused: int
    #: The version of the final parameters, and the metrics stream's entries.
    version: int
    metrics_rows: int
    #: Means over the applied updates (staleness in updates), and the largest staleness.
    staleness_mean: float
    staleness_max: int
    energy_ratio: float
    median_pi: float
    #: The final model; accuracies are None where targets are not class indices.
    train_loss: float
    train_accuracy: float | None
    test_loss: float
    test_accuracy: float | None
    test_samples: int
    parameters: int
    workers: int
    #: Seconds: the aggregator's from its start to the run's end; the whole call's.
    aggregation_time_s: float | None
    wall_time_s: float
    updates_per_s: float | None
    #: "embedded", or the URL of the Redis used, its password hidden.
    redis: str
    #: Each shard's numbers (gemq/records/combine.py: shard_table); one entry for an unsharded run.
    shards: tuple[Mapping[str, Any], ...]
    model_path: Path
    summary_path: Path
    config: RunConfig
    #: Workers that joined the run without being started by this call (``workers``): on a
    #: shared Redis, a worker service that follows new runs, or ``gemq worker --run``.
    workers_joined: int = 0
    #: Why a finished run's result is poor (gemq/records/verdict.py), one sentence each;
    #: empty for a good one, and for a run that did not finish.
    problems: tuple[str, ...] = ()
    #: The settings gemq chose for the model, workers and Redis (their values are in
    #: ``config``: gemq/running/sizing.py), and the most the run could make its Redis hold,
    #: in MB (None for a resumed run: sized when it was created).
    chosen_by_gemq: tuple[str, ...] = ()
    redis_bound_mb: float | None = None
    #: The Redis server's peak memory (``used_memory_peak``, summed over a cluster's
    #: masters), in MB: of this run alone on a private Redis.
    redis_peak_mb: float | None = None
    #: For a model that is not a classifier but whose targets are class indices (a language
    #: model's next bytes): the held-out loss of the training targets' frequencies, the
    #: unigram baseline its test_loss must beat (gemq.training.evaluate.frequency_loss).
    baseline_loss: float | None = None

    @property
    def metrics_path(self) -> Path:
        """The run's curves (gemq.records.curves), written beside its summary."""
        return self.summary_path.with_name(CURVES_FILE)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready fields: paths as strings, the config as a dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(rejected=dict(self.rejected), config=dataclasses.asdict(self.config),
                   problems=list(self.problems), chosen_by_gemq=list(self.chosen_by_gemq),
                   shards=[dict(shard) for shard in self.shards],
                   model_path=str(self.model_path), summary_path=str(self.summary_path))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSummary:
        """A summary from ``to_dict``'s fields (a summary.json, read)."""
        return cls(**{**data, "config": RunConfig.from_dict(data["config"]),
                      "shards": tuple(data["shards"]),
                      "problems": tuple(data.get("problems", ())),
                      "chosen_by_gemq": tuple(data.get("chosen_by_gemq", ())),
                      "model_path": Path(data["model_path"]),
                      "summary_path": Path(data["summary_path"])})

    def write_json(self, path: Path | None = None) -> Path:
        """Write the summary to ``path``, by default its ``summary_path``."""
        return write_json(self.to_dict(), path or self.summary_path)


def run_totals(store: RunStore) -> dict[str, Any]:
    """Counts and run-long averages read back from Redis (combined over the run's shards:
    gemq/records/combine.py). The averages come from shard 0's metrics, where every shard's would
    agree (loss, staleness), and from every shard's energies for the energy ratio."""
    shards = store.shards()
    counters = combine.counters(shards)
    status = store.status()
    rows_by_shard = [[row for _, row in s.metrics_since("0-0", count=10**6)] for s in shards]
    rows = rows_by_shard[0]
    applied = [int(r["applied"]) for r in rows]
    weight = max(sum(applied), 1)
    started, ended = int(status.get("started_ms", 0)), int(status.get("ended_ms", 0))
    return {
        "run_id": store.run_id,
        "state": status["state"],
        "updates_applied": counters.get("applied", 0),
        "published": counters.get("published", 0),
        "rejected": {k.removeprefix("rejected:"): v for k, v in sorted(counters.items())
                     if k.startswith("rejected:")},
        "unused": combine.unused(shards, counters),
        "version": combine.slowest(combine.heads(shards)).version,
        "staleness_mean": _weighted(rows, "staleness_mean", applied, weight),
        "staleness_max": max((int(r["staleness_max"]) for r in rows), default=0),
        "energy_ratio": _energy_ratio([r for shard in rows_by_shard for r in shard]),
        "median_pi": _weighted(rows, "median_pi", applied, weight),
        "aggregation_time_s": (ended - started) / 1000 if ended and started else None,
        "metrics_rows": len(rows),
        "shards": combine.shard_table(shards),
    }


def _energy_ratio(rows: list[dict[str, str]]) -> float:
    """Sum of the central energies over sum of the proxies' (GEM's ratio, over the run)."""
    central = sum(float(r.get("e_central", 0.0)) for r in rows)
    proxy = sum(float(r.get("e_proxy", 0.0)) for r in rows)
    return central / proxy if proxy > 0 else math.nan


def _weighted(rows: list[dict[str, str]], name: str, weights: list[int], total: int) -> float:
    values = [(float(r[name]), w) for r, w in zip(rows, weights, strict=True)
              if not math.isnan(float(r[name]))]
    return sum(v * w for v, w in values) / total if values else math.nan


def write_json(summary: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return path
