"""How a simulation is run (beyond the RunConfig it simulates). Light: no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gemq.config import DCASGD_LAMBDA
from gemq.errors import ConfigError
from gemq.sim.staleness import StalenessModel

#: The most workers one simulation holds (each one a GEM moment in memory).
MAX_WORKERS = 100_000


@dataclass(frozen=True)
class SimOptions:
    workers: int = 4
    staleness: StalenessModel = field(default_factory=StalenessModel)
    #: Central updates between two curve points; 0 means budget / DEFAULT_POINTS.
    eval_every: int = 0
    #: Samples of the fixed training subset (loss) and of the test set (accuracy) per point.
    eval_samples: int = 1000
    #: Per-tensor median and mean pi are recorded every this many updates; 0: with the curve.
    pi_every: int = 0
    dcasgd_lambda: float = DCASGD_LAMBDA
    #: Run the proxy itself (momentum SGD or Adam, one synchronous worker) instead of ``algo``.
    reference: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError("workers", f"must be in [1, {MAX_WORKERS}], got {self.workers}")
        for name in ("eval_every", "pi_every"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.eval_samples < 1:
            raise ConfigError("eval_samples", f"must be at least 1, got {self.eval_samples}")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "staleness": self.staleness.as_dict()}
