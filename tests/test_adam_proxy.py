"""GEM with an Adam proxy, and Adam at the aggregator: against torch.optim.Adam and an
independent float64 reference written from docs/design.md ("GEM with an Adam proxy")."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import gemq
from gemq.aggregation.rules import (
    GEM,
    GLOBAL_MOMENT,
    Adam,
    GlobalGEM,
    SharedAdaptive,
    SharedDownpour,
    make_rule,
)
from gemq.config import ADAM_EPS, DEFAULT_LR, PROXY_STATE_VECTORS, RunConfig, make_config
from gemq.errors import ConfigError
from gemq.layout import ParamLayout
from gemq.shards import ShardPlan
from gemq.state.serverfit import largest_value

LR, BETA1, BETA2, KAPPA, PI_MAX = 1e-2, 0.9, 0.99, 2.0, 5.0


def adam_config(algo: str, proxy: str = "local", **changes: object) -> RunConfig:
    config = RunConfig(run_id="adam", algo=algo, proxy=proxy, optimizer="adam", lr=LR,
                       momentum=BETA1, beta2=BETA2, kappa=KAPPA, pi_max=PI_MAX)
    return config.replace(**changes)


class AdamReference:
    """The rules of docs/design.md in float64, state kept per worker or for the system."""

    def __init__(self, algo: str, size: int, *, shared: bool) -> None:
        self.algo, self.size, self.shared = algo, size, shared
        self.state: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}

    def apply(self, theta: np.ndarray, g: np.ndarray, drift: np.ndarray, worker: str,
              tau: int) -> tuple[np.ndarray, float, float, np.ndarray, np.ndarray]:
        key = "system" if self.shared else worker
        m, v, t = self.state.get(key, (np.zeros(self.size), np.zeros(self.size), 0))
        t += 1
        m = BETA1 * m + (1 - BETA1) * g
        v = BETA2 * v + (1 - BETA2) * g * g
        self.state[key] = (m, v, t)
        d = np.sqrt(v / (1 - BETA2**t)) + ADAM_EPS
        u = -LR * (m / (1 - BETA1**t)) / d  # Adam's step: the proxy's velocity
        delta = -LR * g / d  # the gradient under Adam's preconditioning
        if self.algo == "gem":
            pi = np.clip((KAPPA * np.abs(u) - np.abs(drift)) / (np.abs(delta) + 1e-12),
                         0.0, PI_MAX)
            step = pi * delta
        else:
            pi = np.full(self.size, 1.0 if self.algo == "downpour" else 1.0 / (tau + 1))
            step = pi * u
        theta = theta + step
        e_central = 0.5 * float(np.sum((drift + step) ** 2))
        e_proxy = 0.5 * KAPPA**2 * float(np.sum(u * u))
        return theta, e_central, e_proxy, pi, np.abs(delta if self.algo == "gem" else u)


@pytest.mark.parametrize(("algo", "proxy", "cls"), [
    ("gem", "local", GEM), ("gem", "global", GlobalGEM), ("downpour", "local", SharedDownpour),
    ("adaptive", "local", SharedAdaptive)])
def test_matches_the_float64_reference(algo: str, proxy: str, cls: type) -> None:
    size = 5000
    rng = np.random.default_rng(28)
    rule = make_rule(adam_config(algo, proxy), size)
    assert type(rule) is cls and isinstance(rule.proxy, Adam)
    ref = AdamReference(algo, size, shared=proxy == "global" or algo != "gem")
    theta = rng.normal(0.0, 1.0, size).astype(np.float32)
    theta_ref = theta.astype(np.float64)
    workers = ["w0", "w1", "w2"]
    for step in range(30):
        worker = workers[step % 3] if step < 3 else workers[int(rng.integers(3))]
        tau = int(rng.integers(0, 6))
        g = (rng.normal(0.0, 1.0, size) * rng.uniform(0.1, 3.0)).astype(np.float32)
        drift = (rng.normal(0.0, LR, size) * rng.uniform(0.0, 3.0)).astype(np.float32)
        snapshot = theta - drift
        seen = theta.astype(np.float64) - snapshot
        stats = rule.apply(theta, g, snapshot, worker, tau)
        theta_ref, e_central, e_proxy, pi, weight = ref.apply(
            theta_ref, g.astype(np.float64), seen, worker, tau)
        np.testing.assert_allclose(theta, theta_ref, rtol=1e-4, atol=1e-6)
        # pi weighted by the step it scales: pi alone is ill-conditioned where that is tiny,
        # and kappa |u| - |drift| cancels in float32 (absolute error ~1e-6 of LR).
        np.testing.assert_allclose(rule.last_scale() * weight, pi * weight, rtol=1e-3,
                                   atol=1e-5 * LR)
        assert stats.e_central == pytest.approx(e_central, rel=1e-3)
        assert stats.e_proxy == pytest.approx(e_proxy, rel=1e-3)
    if algo == "gem":  # both clips and the interior were exercised
        assert np.count_nonzero(pi == 0.0) and np.count_nonzero(pi == PI_MAX)
        assert np.count_nonzero((pi > 0) & (pi < PI_MAX))
    assert sorted(rule.workers) == workers


def test_adam_at_the_aggregator_with_one_fresh_worker_is_torch_adam() -> None:
    """DOWNPOUR with Adam, one worker that reads theta after each commit: the synchronous
    proxy, step for step the iterates of torch.optim.Adam."""
    size, rng = 3000, np.random.default_rng(7)
    start = rng.normal(0.0, 1.0, size).astype(np.float32)
    rule = make_rule(adam_config("downpour"), size)
    theta = start.copy()
    weights = torch.nn.Parameter(torch.from_numpy(start.copy()))
    optimizer = torch.optim.Adam([weights], lr=LR, betas=(BETA1, BETA2), eps=ADAM_EPS)
    for _ in range(200):
        g = (rng.normal(0.0, 1.0, size) * rng.uniform(0.01, 10.0)).astype(np.float32)
        rule.apply(theta, g, theta.copy(), "w0", 0)
        weights.grad = torch.from_numpy(g)
        optimizer.step()
    np.testing.assert_allclose(theta, weights.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(theta - start).max() > 10 * LR  # it moved: the comparison means something


def test_a_worker_state_is_both_moments_and_its_step_count_and_survives_a_restart() -> None:
    size, rng = 64, np.random.default_rng(3)
    config = adam_config("gem")
    rule = make_rule(config, size)
    theta = rng.normal(0.0, 1.0, size).astype(np.float32)
    for step in range(5):
        rule.apply(theta, rng.normal(0.0, 1.0, size).astype(np.float32), theta.copy(),
                   f"w{step % 2}", 1)
    saved = {w: m.copy() for w, m in rule.moments().items()}
    assert {w: m.size for w, m in saved.items()} == {"w0": 2 * size + 1, "w1": 2 * size + 1}
    assert (saved["w0"][-1], saved["w1"][-1]) == (3.0, 2.0)  # the steps each worker took
    assert PROXY_STATE_VECTORS["adam"] == 2 and rule.state_size == 2 * size + 1

    restarted = make_rule(config, size)
    restarted.restore(saved)
    restarted.restore({"w9": np.zeros(size, np.float32)})  # a momentum proxy's: skipped
    assert sorted(restarted.workers) == ["w0", "w1"]
    g = rng.normal(0.0, 1.0, size).astype(np.float32)
    snapshot = theta - 0.01
    after, after_restart = theta.copy(), theta.copy()
    rule.apply(after, g, snapshot, "w0", 2)
    restarted.apply(after_restart, g, snapshot, "w0", 2)
    np.testing.assert_array_equal(after, after_restart)


def test_shared_state_is_one_for_the_system() -> None:
    size, rng = 32, np.random.default_rng(4)
    rule = make_rule(adam_config("downpour"), size)
    theta = np.zeros(size, np.float32)
    for worker in ("a", "b", "a"):
        rule.apply(theta, rng.normal(0.0, 1.0, size).astype(np.float32), theta.copy(),
                   worker, 0)
    (name, state), = rule.moments().items()
    assert name == GLOBAL_MOMENT and state[-1] == 3.0
    rule.forget("a")
    assert rule.workers == ["b"] and rule.moments()[GLOBAL_MOMENT][-1] == 3.0


def test_gem_adam_with_no_drift_and_no_momentum_is_rmsprop_times_kappa() -> None:
    """With beta1 = 0 Adam's step is the preconditioned gradient itself: a fresh worker's
    pi is kappa, everywhere (below pi_max)."""
    size = 100
    rule = make_rule(adam_config("gem", momentum=0.0), size)
    theta = np.ones(size, np.float32)
    g = np.random.default_rng(5).normal(0.0, 1.0, size).astype(np.float32)
    rule.apply(theta, g, theta.copy(), "w", 0)
    np.testing.assert_allclose(rule.last_scale(), KAPPA, rtol=1e-5)


def test_dcasgd_has_no_adam_form() -> None:
    with pytest.raises(ConfigError, match="optimizer: dcasgd's delay compensation"):
        make_rule(adam_config("dcasgd"), 10)


@pytest.mark.parametrize(("settings", "lr"), [
    ({}, DEFAULT_LR["momentum"]), ({"optimizer": "adam"}, DEFAULT_LR["adam"]),
    ({"optimizer": "adam", "lr": "auto"}, 1e-3), ({"optimizer": "adam", "lr": None}, 1e-3),
    ({"optimizer": "adam", "lr": 0.02}, 0.02), ({"lr": 0.2}, 0.2)])
def test_a_learning_rate_left_to_gemq_follows_the_optimizer(settings: dict[str, object],
                                                            lr: float) -> None:
    config = make_config(settings, train_samples=100)
    assert math.isclose(config.lr, lr)


def test_an_unknown_optimizer_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="optimizer: must be one of momentum, adam"):
        make_config({"optimizer": "lamb"}, train_samples=100)


def test_the_largest_value_of_an_adam_run_is_a_worker_state() -> None:
    """The private Redis is told to refuse any value above the run's largest: with Adam
    that is a worker's checkpointed state, twice the parameters and its step count."""
    plan = ShardPlan.of(ParamLayout.from_shapes([("w", (100_000,))], []), 1)
    assert largest_value(adam_config("gem"), plan) == 4 * (2 * 100_000 + 1)
    # A gradient message (the parameters' bytes and 64 KiB of slack) with momentum SGD.
    assert largest_value(adam_config("gem", optimizer="momentum"), plan) < 4 * 200_000


def test_gemq_trains_with_an_adam_proxy_and_checkpoints_its_state(tmp_path: Path) -> None:
    """A whole run, checkpointing every commit it can: Adam's states travel to Redis."""
    summary = gemq.train("mlp", "digits", optimizer="adam", steps=150, workers=2,
                         worker_processes=1, batch_size=16, checkpoint_overhead=1.0,
                         out_dir=tmp_path, progress=False)
    assert summary.config.optimizer == "adam" and summary.config.lr == DEFAULT_LR["adam"]
    assert summary.updates_applied == 150 and not summary.problems
    # It learnt: far above the 10% of chance (150 small asynchronous steps: not converged).
    assert summary.test_accuracy is not None and summary.test_accuracy > 0.5
