"""Aggregation rules: pure numpy, no Redis, no torch.

Every rule turns a worker's raw gradient ``g`` into an update of the central variable
``theta`` in place. Notation follows GEM.md: ``delta = -lr * g`` is the unscaled update,
``drift = theta - s`` is how far the central variable moved since the worker read its copy
``s`` (the caller computes it: only the caller knows ``s``), and ``tau`` is the staleness.

All rules keep each worker's moment ``m_w <- mu * m_w + delta`` so that they all report the
same energies: ``E_central = 1/2 sum((drift + scale * delta)^2)`` (the kinetic energy of the
central variable as seen by that worker once the update lands) and
``E_proxy = 1/2 sum((kappa * m_w)^2)`` (the momentum-SGD proxy's). Their ratio is 1 when the
system is compliant, above 1 when it carries more energy than the proxy (DOWNPOUR with many
workers), below 1 when it wastes the workers' work (adaptive staleness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gemq.config import RunConfig
from gemq.errors import ConfigError

#: Medians of pi are taken over at most this many evenly spaced elements: an exact median
#: costs ~1.5 ms on the paper CNN, the strided estimate ~0.1 ms.
MEDIAN_SAMPLE = 16384


@dataclass(frozen=True)
class UpdateStats:
    staleness: int
    median_pi: float
    e_central: float
    e_proxy: float


class Rule:
    """Base: per-worker moments, energy accounting, in-place float32 buffers."""

    name = "rule"

    def __init__(self, size: int, *, lr: float, momentum: float, kappa: float = 1.0) -> None:
        self.size = size
        self.lr = lr
        self.momentum = momentum
        self.kappa = kappa
        self._moments: dict[str, np.ndarray] = {}
        self._delta = np.empty(size, np.float32)
        self._scale = np.empty(size, np.float32)  # per-element pi of the last update
        self._work = np.empty(size, np.float32)

    @property
    def workers(self) -> list[str]:
        """The workers whose state the rule holds."""
        return list(self._moments)

    def forget(self, worker_id: str) -> None:
        """Drop a worker's state (it left, or was silent too long)."""
        self._moments.pop(worker_id, None)

    def last_scale(self) -> np.ndarray:
        """Per-element pi of the last update (read-only view, overwritten by the next)."""
        view = self._scale.view()
        view.flags.writeable = False
        return view

    def apply(self, theta: np.ndarray, gradient: np.ndarray, drift: np.ndarray,
              worker_id: str, staleness: int) -> UpdateStats:
        """Update ``theta`` in place with one worker's gradient; report what happened."""
        # dtype: a float16 wire payload must not drag the arithmetic down to float16 (slow)
        delta = np.multiply(gradient, -self.lr, out=self._delta, dtype=np.float32)
        moment = self._moment(worker_id)
        moment *= self.momentum
        moment += delta
        self._compute_scale(moment, delta, drift, staleness)
        step = np.multiply(self._scale, delta, out=self._work)
        theta += step
        step += drift  # now theta - s after the update: the central variable's velocity
        return UpdateStats(
            staleness=staleness,
            median_pi=median_sample(self._scale),
            e_central=0.5 * float(np.dot(step, step)),
            e_proxy=0.5 * self.kappa**2 * float(np.dot(moment, moment)),
        )

    def _moment(self, worker_id: str) -> np.ndarray:
        moment = self._moments.get(worker_id)
        if moment is None:
            moment = self._moments[worker_id] = np.zeros(self.size, np.float32)
        return moment

    def _compute_scale(self, moment: np.ndarray, delta: np.ndarray, drift: np.ndarray,
                       staleness: int) -> None:
        raise NotImplementedError


class Downpour(Rule):
    """theta <- theta + delta."""

    name = "downpour"

    def _compute_scale(self, moment: np.ndarray, delta: np.ndarray, drift: np.ndarray,
                       staleness: int) -> None:
        self._scale.fill(1.0)


class AdaptiveStaleness(Rule):
    """theta <- theta + delta / (tau + 1)  (DynSGD-like)."""

    name = "adaptive"

    def _compute_scale(self, moment: np.ndarray, delta: np.ndarray, drift: np.ndarray,
                       staleness: int) -> None:
        self._scale.fill(1.0 / (staleness + 1))


class GEM(Rule):
    """Gradient Energy Matching (paper eq. 27): match each worker's energy to its proxy's.

    pi = clip((kappa |m_w| - |theta - s|) / (|delta| + eps), 0, pi_max), element-wise.
    """

    name = "gem"

    def __init__(self, size: int, *, lr: float, momentum: float, kappa: float = 1.0,
                 pi_max: float = 5.0, eps: float = 1e-12) -> None:
        super().__init__(size, lr=lr, momentum=momentum, kappa=kappa)
        self.pi_max = pi_max
        self.eps = eps

    def _compute_scale(self, moment: np.ndarray, delta: np.ndarray, drift: np.ndarray,
                       staleness: int) -> None:
        pi, work = self._scale, self._work
        np.abs(moment, out=pi)
        pi *= self.kappa
        pi -= np.abs(drift, out=work)
        np.abs(delta, out=work)
        work += self.eps
        pi /= work
        np.clip(pi, 0.0, self.pi_max, out=pi)


class GlobalGEM(GEM):
    """GEM with one proxy for the whole system (``proxy = global``, the paper's conclusion).

    The moment is estimated at the aggregator from every worker's raw update, in arrival
    order: ``m <- mu m + delta`` once per central update, instead of once per step of one
    worker. Memory is one moment whatever the number of workers.
    """

    name = "gem-global"

    def __init__(self, size: int, *, lr: float, momentum: float, kappa: float = 1.0,
                 pi_max: float = 5.0, eps: float = 1e-12) -> None:
        super().__init__(size, lr=lr, momentum=momentum, kappa=kappa, pi_max=pi_max, eps=eps)
        self._global = np.zeros(size, np.float32)
        self._seen: dict[str, None] = {}  # insertion-ordered set of the workers heard

    @property
    def workers(self) -> list[str]:
        return list(self._seen)

    def forget(self, worker_id: str) -> None:
        # The shared moment is the system's, not the worker's: it survives the worker.
        self._seen.pop(worker_id, None)

    def _moment(self, worker_id: str) -> np.ndarray:
        self._seen[worker_id] = None
        return self._global


#: DC-ASGD's lambda when the caller does not choose one (see docs/results/README.md).
DCASGD_LAMBDA = 1.0


class DCASGD(Rule):
    """Delay-compensated ASGD (Zheng et al. 2017, constant lambda):
    theta <- theta - lr (g + lambda g * g * (theta - s)).

    The element-wise Taylor correction g * g * drift approximates how the gradient moved
    while the worker computed. As a scale of delta = -lr g it is 1 + lambda g drift, which
    is what ``last_scale`` (and median pi) report.
    """

    name = "dcasgd"

    def __init__(self, size: int, *, lr: float, momentum: float, kappa: float = 1.0,
                 lam: float = DCASGD_LAMBDA) -> None:
        super().__init__(size, lr=lr, momentum=momentum, kappa=kappa)
        self.lam = lam

    def _compute_scale(self, moment: np.ndarray, delta: np.ndarray, drift: np.ndarray,
                       staleness: int) -> None:
        scale = self._scale
        np.multiply(delta, drift, out=scale)
        scale *= -self.lam / self.lr  # g = -delta / lr
        scale += 1.0


def median_sample(values: np.ndarray) -> float:
    """Median of ``values``, estimated on at most MEDIAN_SAMPLE evenly spaced elements."""
    if values.size == 0:
        return math.nan
    stride = -(-values.size // MEDIAN_SAMPLE)  # ceiling division
    return float(np.median(values[::stride]))


def make_rule(config: RunConfig, size: int, *,
              dcasgd_lambda: float = DCASGD_LAMBDA) -> Rule:
    """The rule a run's configuration asks for (``dcasgd_lambda``: DC-ASGD's lambda)."""
    common = {"lr": config.lr, "momentum": config.momentum, "kappa": config.kappa}
    if config.algo == "gem":
        gem = GlobalGEM if config.proxy == "global" else GEM
        return gem(size, pi_max=config.pi_max, eps=config.eps, **common)
    if config.proxy != "local":
        raise ConfigError("proxy", f"{config.proxy!r} is a GEM option; algo "
                                   f"{config.algo!r} has no proxy to estimate")
    if config.algo == "downpour":
        return Downpour(size, **common)
    if config.algo == "dcasgd":
        if not (math.isfinite(dcasgd_lambda) and dcasgd_lambda >= 0):
            raise ConfigError("dcasgd_lambda", f"must be finite and >= 0, got {dcasgd_lambda}")
        return DCASGD(size, lam=dcasgd_lambda, **common)
    return AdaptiveStaleness(size, **common)
