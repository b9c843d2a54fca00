"""What the paper experiments run: the rules compared, the settings, the budgets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """A rule as the figures name it."""

    label: str
    algo: str = "gem"
    proxy: str = "local"
    #: The proxy itself (one synchronous worker), not an asynchronous rule.
    reference: bool = False
    #: The proxy's optimizer (benchmarks/adam.py compares Adam's rules).
    optimizer: str = "momentum"


GEM = Variant("GEM")
DOWNPOUR = Variant("DOWNPOUR", "downpour")
ADAPTIVE = Variant("adaptive staleness", "adaptive")
GLOBAL = Variant("GEM, global proxy", proxy="global")
DCASGD = Variant("DC-ASGD", "dcasgd")
PROXY = Variant("proxy (momentum SGD)", reference=True)
#: Beyond the paper: run through the same experiments as the paper's rules.
BEYOND = (GLOBAL, DCASGD)
ALL = (GEM, DOWNPOUR, ADAPTIVE, GLOBAL, DCASGD, PROXY)


@dataclass(frozen=True)
class Setting:
    """One experiment point, run once per seed (hashable: the runs are keyed by it)."""

    variant: Variant
    workers: int
    updates: int
    lr: float = 0.05
    kappa: float = 1.0

    def describe(self) -> dict[str, object]:
        return {"rule": self.variant.label, "workers": self.workers, "updates": self.updates,
                "lr": self.lr, "kappa": self.kappa}


@dataclass(frozen=True)
class Plan:
    """Budgets of one regeneration. The defaults are the full set (about 20 min, 2 cores)."""

    #: Worker counts of figures 1 and 3.
    ns: tuple[int, ...] = (5, 10, 20, 30)
    #: Figure 2.
    n_large: int = 100
    #: One epoch of the 4,000 mnist5k training samples at batch 64 (the paper's budget).
    steps_per_worker: int = 62
    seeds: tuple[int, ...] = (0, 1, 2)
    #: Workers of figure 6 (eta = 0.1) and of figure 8 (kappa).
    n_lr: int = 10
    n_kappa: int = 20
    kappas: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0)
    #: Workers of the per-tensor median pi heat map.
    n_heatmap: int = 20
    #: Curve points per run, and the interval (updates) of per-tensor median pi.
    points: int = 16
    pi_every: int = 10
    model: str = "cnn"
    dataset: str = "mnist5k"
    eval_samples: int = 1000
    #: Worker counts of the speed measurement, and the updates timed after warm-up.
    bench_workers: tuple[int, ...] = (5, 100, 1000)
    bench_updates: int = 300
    bench_rounds: int = 3
