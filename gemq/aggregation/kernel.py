"""The element-wise update every rule makes, fused into one compiled loop per proxy:
``update`` for momentum SGD (the paper's), ``adam_update`` for Adam.

One pass over the parameters does what took numpy some fifteen: the moment, the scale
(pi), the step on theta and both energies, and the drift ``theta - s`` they all start from.
Numpy needs a temporary array and a full trip through memory for every operation; the loop
reads gradient, snapshot, moment and theta once and writes theta, moment and the scale
once (the speed-up is measured in docs/performance.md).

numba compiles it on first use and caches the machine code (gemq/jit.py).

The fastmath flags allow reassociation (the energy sums are vectorised, in float64) and
contraction (fused multiply-add) and assume no NaN or infinity: every gradient is checked
finite and bounded before it gets here. Division stays exact (no approximate reciprocal).
"""

from __future__ import annotations

import functools

import numpy as np

from gemq.jit import compiled

#: How the per-element scale pi is computed (see ``update``).
GEM, CONSTANT, DELAY_COMPENSATED = 0, 1, 2

_FASTMATH = {"reassoc", "contract", "nsz", "nnan", "ninf"}


@functools.partial(compiled, fastmath=_FASTMATH)
def update(theta: np.ndarray, gradient: np.ndarray, snapshot: np.ndarray,
           moment: np.ndarray, scale: np.ndarray, lr: np.float32, momentum: np.float32,
           kappa: np.float32, mode: int, a: np.float32, b: np.float32) -> tuple[float, float]:
    """Update ``theta``, ``moment`` and ``scale`` in place; return (E_central, E_proxy).

    Per element, with ``delta = -lr * g`` and ``drift = theta - snapshot`` (how far the
    central variable moved since the worker read ``snapshot``): ``m <- momentum * m + delta``;
    then the scale

    - GEM: ``pi = clip((kappa |m| - |drift|) / (|delta| + b), 0, a)`` (a = pi_max, b = eps);
    - CONSTANT: ``pi = a``;
    - DELAY_COMPENSATED: ``pi = 1 + a * delta * drift`` (a = -lambda / lr);

    ``theta += pi * delta``; ``E_central = 1/2 sum((drift + pi * delta)^2)`` and
    ``E_proxy = 1/2 kappa^2 sum(m^2)``, accumulated in float64.
    """
    central = 0.0
    proxy = 0.0
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(theta.shape[0]):
        delta = -lr * gradient[i]
        m = momentum * moment[i] + delta
        moment[i] = m
        moved = theta[i] - snapshot[i]
        if mode == GEM:
            pi = (kappa * abs(m) - abs(moved)) / (abs(delta) + b)
            pi = pi if pi > zero else zero
            pi = pi if pi < a else a
        elif mode == CONSTANT:
            pi = a
        else:
            pi = one + a * delta * moved
        scale[i] = pi
        step = pi * delta
        theta[i] += step
        velocity = np.float64(step + moved)
        central += velocity * velocity
        proxy += np.float64(m) * np.float64(m)
    return 0.5 * central, 0.5 * np.float64(kappa) * np.float64(kappa) * proxy


@functools.partial(compiled, fastmath=_FASTMATH)
def adam_update(theta: np.ndarray, gradient: np.ndarray, snapshot: np.ndarray,
                first: np.ndarray, second: np.ndarray, scale: np.ndarray, lr: np.float32,
                beta1: np.float32, beta2: np.float32, adam_eps: np.float32,
                bias1: np.float32, bias2: np.float32, kappa: np.float32, mode: int,
                a: np.float32, b: np.float32) -> tuple[float, float]:
    """The update of a rule whose proxy is Adam: ``theta``, the moments ``first`` and
    ``second`` and ``scale`` in place; return (E_central, E_proxy).

    Per element, with ``g`` the gradient and ``bias1 = 1 - beta1^t``, ``bias2 = 1 - beta2^t``
    the bias corrections of the moments' t-th step: ``first <- beta1 first + (1 - beta1) g``
    and ``second <- beta2 second + (1 - beta2) g^2``; Adam's denominator
    ``d = sqrt(second / bias2) + adam_eps``; the proxy's step (Adam's) ``u = -lr first /
    bias1 / d`` and the worker's unscaled update, its gradient under Adam's preconditioning
    with no momentum, ``delta = -lr g / d``. Then, with ``drift = theta - snapshot``:

    - GEM: ``pi = clip((kappa |u| - |drift|) / (|delta| + b), 0, a)`` and the step
      ``pi * delta`` (a = pi_max, b = eps);
    - CONSTANT: the step ``a * u``, Adam's own step scaled (``pi = a``).

    ``theta += step``; ``E_central = 1/2 sum((drift + step)^2)`` and
    ``E_proxy = 1/2 kappa^2 sum(u^2)``, accumulated in float64.
    """
    central = 0.0
    proxy = 0.0
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(theta.shape[0]):
        g = gradient[i]
        m = beta1 * first[i] + (one - beta1) * g
        v = beta2 * second[i] + (one - beta2) * g * g
        first[i] = m
        second[i] = v
        denominator = np.float32(np.sqrt(v / bias2)) + adam_eps
        u = -lr * (m / bias1) / denominator
        moved = theta[i] - snapshot[i]
        if mode == GEM:
            delta = -lr * g / denominator
            pi = (kappa * abs(u) - abs(moved)) / (abs(delta) + b)
            pi = pi if pi > zero else zero
            pi = pi if pi < a else a
            step = pi * delta
        else:
            pi = a
            step = a * u
        scale[i] = pi
        theta[i] += step
        velocity = np.float64(step + moved)
        central += velocity * velocity
        proxy += np.float64(u) * np.float64(u)
    return 0.5 * central, 0.5 * np.float64(kappa) * np.float64(kappa) * proxy


def warm_up(adam: bool = False) -> None:
    """Compile (or load from the cache) now, not on the first real update: ``update``, or
    ``adam_update`` for a rule whose proxy is Adam."""
    tiny = np.zeros(1, np.float32)
    f32 = np.float32
    if adam:
        adam_update(tiny, tiny, tiny, tiny.copy(), tiny.copy(), tiny.copy(), f32(1e-3),
                    f32(0.9), f32(0.999), f32(1e-8), f32(0.1), f32(1e-3), f32(1.0), GEM,
                    f32(1.0), f32(1e-12))
    else:
        update(tiny, tiny, tiny, tiny.copy(), tiny.copy(), f32(0.1), f32(0.9), f32(1.0), GEM,
               f32(1.0), f32(1e-12))
