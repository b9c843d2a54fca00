"""Running sums over applied updates: what the metrics rows and curve points report.

The aggregator keeps one per commit window (gemq/aggregation/aggregator.py), the simulator one per
curve point and one over the whole run (gemq/sim/engine.py): both report the same
quantities, computed the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gemq.aggregation.rules import UpdateStats


@dataclass
class UpdateTally:
    """Sums over the updates applied in some span; ``means()`` gives the averages."""

    updates: int = 0
    samples: int = 0
    loss_sum: float = 0.0  # weighted by samples
    #: Weighted by samples too, over the updates whose sender measured an accuracy only.
    accuracy_sum: float = 0.0
    accuracy_samples: int = 0
    e_central: float = 0.0
    e_proxy: float = 0.0
    median_pi_sum: float = 0.0
    mean_pi_sum: float = 0.0  # only where the caller measures it (the simulator)
    staleness_sum: int = 0
    staleness_min: int | None = None
    staleness_max: int = 0

    def add(self, stats: UpdateStats, loss: float, samples: int,
            mean_pi: float = 0.0, accuracy: float | None = None) -> None:
        self.updates += 1
        self.samples += samples
        self.loss_sum += loss * samples
        if accuracy is not None:
            self.accuracy_sum += accuracy * samples
            self.accuracy_samples += samples
        self.e_central += stats.e_central
        self.e_proxy += stats.e_proxy
        self.median_pi_sum += stats.median_pi
        self.mean_pi_sum += mean_pi
        self.staleness_sum += stats.staleness
        low = self.staleness_min
        self.staleness_min = stats.staleness if low is None else min(low, stats.staleness)
        self.staleness_max = max(self.staleness_max, stats.staleness)

    @property
    def energy_ratio(self) -> float:
        """E_central / E_proxy: 1 when compliant; NaN before any energy was seen."""
        return self.e_central / self.e_proxy if self.e_proxy > 0 else math.nan

    def means(self) -> dict[str, float]:
        """Averages per update (NaN where no update was applied; for the accuracy, where
        none of the updates came with one)."""
        n = self.updates or math.nan
        return {"loss": self.loss_sum / self.samples if self.samples else math.nan,
                "accuracy": (self.accuracy_sum / self.accuracy_samples
                             if self.accuracy_samples else math.nan),
                "energy_ratio": self.energy_ratio, "median_pi": self.median_pi_sum / n,
                "mean_pi": self.mean_pi_sum / n, "staleness_mean": self.staleness_sum / n,
                "staleness_min": math.nan if self.staleness_min is None
                else float(self.staleness_min),
                "staleness_max": float(self.staleness_max) if self.updates else math.nan}
