"""Aggregation rules: numpy and one compiled kernel (gemq.aggregation.kernel), no Redis or torch.

Every rule turns a worker's raw gradient ``g`` into an update of the central variable
``theta`` in place. Notation follows the GEM paper (J. Hermans, G. Louppe, arXiv:1805.08469,
eq. 27 and Algorithm 1), as docs/design.md ("The GEM rule") writes it: ``delta = -lr * g``
is the unscaled update, ``drift = theta - s`` is how far the central variable moved since
the worker read its copy ``s`` (the caller passes ``s``; the kernel computes the drift in
its one pass), and ``tau`` is the staleness.

All rules keep each worker's moment ``m_w <- mu * m_w + delta`` so that they all report the
same energies: ``E_central = 1/2 sum((drift + scale * delta)^2)`` (the kinetic energy of the
central variable as seen by that worker once the update lands) and
``E_proxy = 1/2 sum((kappa * m_w)^2)`` (the momentum-SGD proxy's). Their ratio is 1 when the
system is compliant, above 1 when it carries more energy than the proxy (DOWNPOUR with many
workers), below 1 when it wastes the workers' work (adaptive staleness).

A rule only says how its scale is computed (``_scale``, a ``ScaleRule``); the update itself
is one fused pass over the parameters, the same for every rule.

The proxy's optimizer (``Proxy``) is the rule's other half. ``MomentumSGD`` is the
paper's, as above. ``Adam`` keeps Adam's two moments per worker instead of one and matches
its step: ``delta`` becomes the gradient under Adam's preconditioning, ``-lr g / d``, and
the proxy's velocity Adam's own step ``u = -lr m_hat / d`` (gemq/aggregation/kernel.py's
``adam_update``; docs/design.md, "GEM with an Adam proxy", derives it). The CONSTANT rules
then scale Adam's step: DOWNPOUR with Adam is Adam applied to stale gradients at the
aggregator, with one state for the run.

A run's state vector may hold buffers after its parameters (gemq/layout.py). A rule's
``size`` is the parameters' part; whatever follows it in ``theta`` is buffers, and the
matching tail of a worker's vector is the change its step made to them, ``d = v - s``. Each
buffer element has a momentum m (``buffer_momenta``, from the layout), and the update is

    c <- c + d - m (c - s)

with ``c`` the run's value and ``s`` the worker's copy (the snapshot). For an exponential
moving average (BatchNorm's running mean and variance: ``v = (1 - m) s + m b``, b the
batch's statistic) this is ``(1 - m) c + m b``: the worker's step applied to the run's
current value, exactly, however stale its copy. (Adding ``d`` alone would move ``c`` by
``m (b - s)``: k workers that read the same old ``s`` would pull it k times as far, and a
running variance could overshoot below 0.) With m = 0 (a batch count, a cumulative average,
any other buffer) the change is added as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gemq.aggregation import kernel
from gemq.config import ADAM_BETA2, ADAM_EPS, DCASGD_LAMBDA, RunConfig
from gemq.errors import ConfigError

#: Medians of pi are taken over at most this many evenly spaced elements, once per update:
#: an exact median of a large model would cost more than the update itself.
MEDIAN_SAMPLE = 4096
#: The per-tensor medians of the dashboard's heat map, one set per commit, need less.
TENSOR_MEDIAN_SAMPLE = 2048


class ScaleRule(NamedTuple):
    """How gemq.aggregation.kernel.update computes a rule's per-element scale pi: the
    kernel's ``mode`` and its two parameters (GEM: a = pi_max, b = eps; CONSTANT: pi = a;
    DELAY_COMPENSATED: a = -lambda / lr)."""

    mode: int
    a: float
    b: float = 0.0


#: The checkpoint name of GlobalGEM's one moment (not a valid worker id: no clash).
GLOBAL_MOMENT = "~global"


@dataclass(frozen=True)
class UpdateStats:
    staleness: int
    median_pi: float
    e_central: float
    e_proxy: float


class Proxy:
    """The proxy's optimizer: the state a rule keeps per worker, and the fused update."""

    name = "proxy"

    def state_size(self, size: int) -> int:
        """float32 elements of one worker's state for ``size`` parameters."""
        raise NotImplementedError

    def update(self, rule: Rule, theta: np.ndarray, gradient: np.ndarray,
               snapshot: np.ndarray, state: np.ndarray, scale: ScaleRule) -> tuple[float, float]:
        """Update ``theta``, ``state`` and the rule's pi in place; (E_central, E_proxy)."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Compile the update's kernel now (or load it from the cache)."""
        raise NotImplementedError


class MomentumSGD(Proxy):
    """The paper's proxy: m <- mu m + delta, one moment per worker."""

    name = "momentum"

    def state_size(self, size: int) -> int:
        return size

    def update(self, rule: Rule, theta: np.ndarray, gradient: np.ndarray,
               snapshot: np.ndarray, state: np.ndarray, scale: ScaleRule) -> tuple[float, float]:
        f32 = np.float32
        return kernel.update(theta, gradient, snapshot, state, rule.scale_buffer, f32(rule.lr),
                             f32(rule.momentum), f32(rule.kappa), scale.mode, f32(scale.a),
                             f32(scale.b))

    def warm_up(self) -> None:
        kernel.warm_up()


class Adam(Proxy):
    """Adam as the proxy (Kingma & Ba 2015, with bias correction, as torch.optim.Adam):
    beta1 is the rule's momentum. A worker's state is one float32 array, its first moment,
    then its second, then its step count t: what a checkpoint stores as it is."""

    name = "adam"

    def __init__(self, beta2: float = ADAM_BETA2, eps: float = ADAM_EPS) -> None:
        self.beta2 = beta2
        self.eps = eps

    def state_size(self, size: int) -> int:
        return 2 * size + 1

    def update(self, rule: Rule, theta: np.ndarray, gradient: np.ndarray,
               snapshot: np.ndarray, state: np.ndarray, scale: ScaleRule) -> tuple[float, float]:
        n = theta.size
        # t counts in float32, exact up to 2^24 steps; by then both corrections are 1.
        steps = float(state[2 * n]) + 1.0
        state[2 * n] = steps
        f32 = np.float32
        bias1 = f32(-math.expm1(steps * math.log(rule.momentum))) if rule.momentum else f32(1)
        bias2 = f32(-math.expm1(steps * math.log(self.beta2)))
        return kernel.adam_update(theta, gradient, snapshot, state[:n], state[n:2 * n],
                                  rule.scale_buffer, f32(rule.lr), f32(rule.momentum),
                                  f32(self.beta2), f32(self.eps), bias1, bias2,
                                  f32(rule.kappa), scale.mode, f32(scale.a), f32(scale.b))

    def warm_up(self) -> None:
        kernel.warm_up(adam=True)


def make_proxy(config: RunConfig) -> Proxy:
    """The proxy optimizer a run's configuration names."""
    if config.optimizer == "adam":
        return Adam(config.beta2, config.adam_eps)
    return MomentumSGD()


class Rule:
    """Base: per-worker proxy state, energy accounting, in-place float32 buffers."""

    name = "rule"

    def __init__(self, size: int, *, lr: float, momentum: float, kappa: float = 1.0,
                 proxy: Proxy | None = None,
                 buffer_momenta: np.ndarray | None = None) -> None:
        self.size = size
        self.lr = lr
        self.momentum = momentum
        self.kappa = kappa
        self.proxy = proxy or MomentumSGD()
        self.state_size = self.proxy.state_size(size)
        self._moments: dict[str, np.ndarray] = {}
        self.scale_buffer = np.empty(size, np.float32)  # per-element pi of the last update
        # The buffers' momenta (None: all 0) and the scratch of their update.
        self._buffer_momenta = (None if buffer_momenta is None
                                else np.array(buffer_momenta, np.float32).reshape(-1))
        self._correction = (None if self._buffer_momenta is None
                            else np.empty_like(self._buffer_momenta))
        self.proxy.warm_up()

    @property
    def workers(self) -> list[str]:
        """The workers whose state the rule holds."""
        return list(self._moments)

    def forget(self, worker_id: str) -> None:
        """Drop a worker's state (it left, or was silent too long)."""
        self._moments.pop(worker_id, None)

    def moments(self) -> dict[str, np.ndarray]:
        """The state to checkpoint for a restart: each worker's proxy state, by worker id."""
        return dict(self._moments)

    def restore(self, moments: dict[str, np.ndarray]) -> None:
        """Take back checkpointed moments (a new leader's start); wrong sizes (another
        proxy's, another shard's) are skipped."""
        for worker_id, moment in moments.items():
            if moment.size == self.state_size:
                self._moments[worker_id] = np.array(moment, np.float32)

    def last_scale(self) -> np.ndarray:
        """Per-element pi of the last update (read-only view, overwritten by the next)."""
        view = self.scale_buffer.view()
        view.flags.writeable = False
        return view

    def apply(self, theta: np.ndarray, gradient: np.ndarray, snapshot: np.ndarray,
              worker_id: str, staleness: int) -> UpdateStats:
        """Update ``theta`` in place with one worker's gradient; report what happened.

        ``snapshot`` is the copy of the parameters the worker computed the gradient on
        (the drift is ``theta - snapshot``). ``theta``, ``snapshot`` and the gradient are
        flat float32 arrays (a gradient of another dtype is widened first): the rule's size
        of parameters, then any buffers, whose changes are applied as the module's
        docstring says.
        """
        if gradient.dtype != np.float32 or not gradient.flags.c_contiguous:
            gradient = np.ascontiguousarray(gradient, dtype=np.float32)
        n = self.size
        e_central, e_proxy = self.proxy.update(self, theta[:n], gradient[:n], snapshot[:n],
                                               self._moment(worker_id), self._scale(staleness))
        if theta.size > n:
            self._apply_buffers(theta[n:], gradient[n:], snapshot[n:])
        return UpdateStats(staleness=staleness, median_pi=median_sample(self.scale_buffer),
                           e_central=float(e_central), e_proxy=float(e_proxy))

    def _apply_buffers(self, value: np.ndarray, change: np.ndarray,
                       snapshot: np.ndarray) -> None:
        """c <- c + d - m (c - s), in place on the buffers' part of theta."""
        momenta, correction = self._buffer_momenta, self._correction
        if momenta is None or correction is None:
            value += change
            return
        if momenta.size != value.size:
            raise ValueError(f"{value.size} buffer elements after the parameters; the rule "
                             f"has momenta for {momenta.size}")
        np.subtract(value, snapshot, out=correction)
        correction *= momenta
        value += change
        value -= correction

    def _moment(self, worker_id: str) -> np.ndarray:
        moment = self._moments.get(worker_id)
        if moment is None:
            moment = self._moments[worker_id] = np.zeros(self.state_size, np.float32)
        return moment

    def _scale(self, staleness: int) -> ScaleRule:
        """How this rule scales an update of the given staleness."""
        raise NotImplementedError


class Downpour(Rule):
    """theta <- theta + delta."""

    name = "downpour"

    def _scale(self, staleness: int) -> ScaleRule:
        return ScaleRule(kernel.CONSTANT, 1.0)


class AdaptiveStaleness(Rule):
    """theta <- theta + delta / (tau + 1)  (DynSGD-like)."""

    name = "adaptive"

    def _scale(self, staleness: int) -> ScaleRule:
        return ScaleRule(kernel.CONSTANT, 1.0 / (staleness + 1))


class GEM(Rule):
    """Gradient Energy Matching (paper eq. 27): match each worker's energy to its proxy's.

    pi = clip((kappa |m_w| - |theta - s|) / (|delta| + eps), 0, pi_max), element-wise.
    """

    name = "gem"

    def __init__(self, size: int, *, lr: float, momentum: float, kappa: float = 1.0,
                 pi_max: float = 5.0, eps: float = 1e-12, proxy: Proxy | None = None,
                 buffer_momenta: np.ndarray | None = None) -> None:
        super().__init__(size, lr=lr, momentum=momentum, kappa=kappa, proxy=proxy,
                         buffer_momenta=buffer_momenta)
        self.pi_max = pi_max
        self.eps = eps

    def _scale(self, staleness: int) -> ScaleRule:
        return ScaleRule(kernel.GEM, self.pi_max, self.eps)


class SharedState(Rule):
    """A rule with one proxy state for the whole system instead of one per worker: updated
    from every worker's gradient in arrival order, once per central update. Memory is one
    proxy state whatever the number of workers. Put it first among a rule's bases."""

    def __init__(self, size: int, **kwargs: Any) -> None:
        super().__init__(size, **kwargs)
        self._global = np.zeros(self.state_size, np.float32)
        self._seen: dict[str, None] = {}  # insertion-ordered set of the workers heard

    @property
    def workers(self) -> list[str]:
        return list(self._seen)

    def forget(self, worker_id: str) -> None:
        # The shared state is the system's, not the worker's: it survives the worker.
        self._seen.pop(worker_id, None)

    def _moment(self, worker_id: str) -> np.ndarray:
        self._seen[worker_id] = None
        return self._global

    def moments(self) -> dict[str, np.ndarray]:
        return {GLOBAL_MOMENT: self._global}

    def restore(self, moments: dict[str, np.ndarray]) -> None:
        moment = moments.get(GLOBAL_MOMENT)
        if moment is not None and moment.size == self.state_size:
            self._global[:] = moment


class GlobalGEM(SharedState, GEM):
    """GEM with one proxy for the whole system (``proxy = global``, the paper's conclusion).

    The moment is estimated at the aggregator from every worker's raw update, in arrival
    order: ``m <- mu m + delta`` once per central update, instead of once per step of one
    worker (with Adam, both moments and the step count).
    """

    name = "gem-global"


class SharedDownpour(SharedState, Downpour):
    """DOWNPOUR with Adam: Adam applied at the aggregator to each gradient as it arrives,
    however stale, with one state for the run (an Adam optimizer on a parameter server)."""


class SharedAdaptive(SharedState, AdaptiveStaleness):
    """Adaptive staleness with Adam: the aggregator's one Adam step divided by tau + 1."""


class DCASGD(Rule):
    """Delay-compensated ASGD (Zheng et al. 2017, constant lambda):
    theta <- theta - lr (g + lambda g * g * (theta - s)).

    The element-wise Taylor correction g * g * drift approximates how the gradient moved
    while the worker computed. As a scale of delta = -lr g it is 1 + lambda g drift, which
    is what ``last_scale`` (and median pi) report.
    """

    name = "dcasgd"

    def __init__(self, size: int, *, lr: float, momentum: float, kappa: float = 1.0,
                 lam: float = DCASGD_LAMBDA, proxy: Proxy | None = None,
                 buffer_momenta: np.ndarray | None = None) -> None:
        super().__init__(size, lr=lr, momentum=momentum, kappa=kappa, proxy=proxy,
                         buffer_momenta=buffer_momenta)
        self.lam = lam

    def _scale(self, staleness: int) -> ScaleRule:
        return ScaleRule(kernel.DELAY_COMPENSATED, -self.lam / self.lr)  # g = -delta / lr


def median_sample(values: np.ndarray, limit: int = MEDIAN_SAMPLE) -> float:
    """Median of ``values``, estimated on at most ``limit`` evenly spaced elements.

    Sorts the sample: ``np.median`` spends more in its Python layers than in the selection
    on samples this small, and ``np.partition`` slows down badly on many equal values, which
    is what pi is (clipped to 0 and pi_max); docs/performance.md has the measurements.
    """
    if values.size == 0:
        return math.nan
    stride = -(-values.size // limit)  # ceiling division
    ordered = np.sort(values[::stride])
    middle = ordered.size // 2
    if ordered.size % 2:
        return float(ordered[middle])
    return (float(ordered[middle - 1]) + float(ordered[middle])) / 2


def make_rule(config: RunConfig, size: int, *, dcasgd_lambda: float = DCASGD_LAMBDA,
              buffer_momenta: np.ndarray | None = None) -> Rule:
    """The rule a run's configuration asks for (``dcasgd_lambda``: DC-ASGD's lambda;
    ``buffer_momenta``: the momentum of each buffer element after the ``size`` parameters,
    ParamLayout.buffer_momenta, None when all are 0)."""
    proxy = make_proxy(config)
    adam = isinstance(proxy, Adam)
    common: dict[str, Any] = {"lr": config.lr, "momentum": config.momentum,
                              "kappa": config.kappa, "proxy": proxy,
                              "buffer_momenta": buffer_momenta}
    if config.algo == "gem":
        gem = GlobalGEM if config.proxy == "global" else GEM
        return gem(size, pi_max=config.pi_max, eps=config.eps, **common)
    if config.proxy != "local":
        raise ConfigError("proxy", f"{config.proxy!r} is a GEM option; algo "
                                   f"{config.algo!r} has no proxy to estimate")
    if config.algo == "downpour":
        return (SharedDownpour if adam else Downpour)(size, **common)
    if config.algo == "dcasgd":
        if adam:
            raise ConfigError("optimizer", "dcasgd's delay compensation corrects plain SGD "
                                           "steps; it has no Adam form (use --optimizer "
                                           "momentum, or --algo gem or downpour with adam)")
        if not (math.isfinite(dcasgd_lambda) and dcasgd_lambda >= 0):
            raise ConfigError("dcasgd_lambda", f"must be finite and >= 0, got {dcasgd_lambda}")
        return DCASGD(size, lam=dcasgd_lambda, **common)
    return (SharedAdaptive if adam else AdaptiveStaleness)(size, **common)
