"""Aggregation rules: hand-worked cases, an independent float64 reference, construction."""

from __future__ import annotations

import numpy as np
import pytest

from gemq.aggregation.rules import (
    GEM,
    MEDIAN_SAMPLE,
    AdaptiveStaleness,
    Downpour,
    UpdateStats,
    make_rule,
    median_sample,
)
from gemq.config import RunConfig


def f32(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def assert_stats(stats: UpdateStats, *, staleness: int, median_pi: float, e_central: float,
                 e_proxy: float) -> None:
    assert stats.staleness == staleness
    assert stats.median_pi == pytest.approx(median_pi, rel=1e-6, abs=1e-9)
    assert stats.e_central == pytest.approx(e_central, rel=1e-6)
    assert stats.e_proxy == pytest.approx(e_proxy, rel=1e-6)


# --------------------------------------------------------------------------------------------
# Cases worked by hand. Every number is a power-of-two fraction, so float32 is exact.
# --------------------------------------------------------------------------------------------

def gem_case() -> GEM:
    return GEM(4, lr=0.5, momentum=0.5, kappa=2.0, pi_max=1.5)


# First update of worker "a" (moment starts at zero):
#   g      = [-2,    4,    1,    -1  ]
#   delta  = -0.5 g           = [ 1,   -2,   -0.5,  0.5 ]
#   m_a    = 0.5*0 + delta    = [ 1,   -2,   -0.5,  0.5 ]
#   kappa|m|                  = [ 2,    4,    1,    1   ]
#   drift  = [0,   1.5,  3,    0.5]
#   num    = kappa|m| - |drift| = [ 2,  2.5,  -2,   0.5 ]
#   den    = |delta| + eps    = [ 1,    2,    0.5,  0.5 ]   (eps vanishes in float32)
#   raw pi = num / den        = [ 2,    1.25, -4,   1   ]
#   pi     = clip(., 0, 1.5)  = [ 1.5,  1.25,  0,   1   ]   (elt 0 at pi_max, elt 2 at 0)
#   step   = pi * delta       = [ 1.5, -2.5,   0,   0.5 ]
#   theta  = [1, 2, 3, 4] + step = [2.5, -0.5, 3, 4.5]
#   step + drift              = [ 1.5, -1,     3,   1   ]
#   e_central = (2.25 + 1 + 9 + 1) / 2          = 6.625
#   e_proxy   = 1/2 * 2^2 * (1 + 4 + 0.25 + 0.25) = 11.0
#   median_pi = median(1.5, 1.25, 0, 1) = (1 + 1.25) / 2 = 1.125
G1 = f32([-2, 4, 1, -1])
D1 = f32([0, 1.5, 3, 0.5])
THETA0 = [1, 2, 3, 4]
PI1 = [1.5, 1.25, 0, 1]
THETA1 = [2.5, -0.5, 3, 4.5]

# Second update of worker "a", theta = THETA1, staleness 2:
#   g      = [-1,   0,    2,    0.5 ]
#   delta  = -0.5 g           = [ 0.5,  0,   -1,   -0.25]
#   m_a    = 0.5*[1,-2,-0.5,0.5] + delta = [0.5,-1,-0.25,0.25] + delta = [1, -1, -1.25, 0]
#   kappa|m|                  = [ 2,    2,    2.5,  0   ]
#   drift  = [1.5,  0.5,  2,    0.25]
#   num                       = [ 0.5,  1.5,  0.5, -0.25]
#   den    = |delta| + eps    = [ 0.5,  1e-12, 1,   0.25]
#   raw pi                    = [ 1,  1.5e12, 0.5, -1   ]
#   pi                        = [ 1,    1.5,  0.5,  0   ]   (elt 1: delta = 0, pi = pi_max)
#   step   = pi * delta       = [ 0.5,  0,   -0.5,  0   ]
#   theta  = [2.5,-0.5,3,4.5] + step = [3, -0.5, 2.5, 4.5]
#   step + drift              = [ 2,    0.5,  1.5,  0.25]
#   e_central = (4 + 0.25 + 2.25 + 0.0625) / 2 = 3.28125
#   e_proxy   = 1/2 * 4 * (1 + 1 + 1.5625 + 0) = 7.125
#   median_pi = median(1, 1.5, 0.5, 0) = (0.5 + 1) / 2 = 0.75
# (Had the moment not accumulated, m = delta and kappa|m| = [1, 0, 2, 0.5]: pi = [0, 0, 0, 0].)
G2 = f32([-1, 0, 2, 0.5])
D2 = f32([1.5, 0.5, 2, 0.25])
PI2 = [1, 1.5, 0.5, 0]
THETA2 = [3, -0.5, 2.5, 4.5]


def test_gem_first_update_by_hand() -> None:
    rule = gem_case()
    theta = f32(THETA0)
    stats = rule.apply(theta, G1, theta - D1, "a", 0)
    np.testing.assert_array_equal(rule.last_scale(), f32(PI1))
    np.testing.assert_array_equal(theta, f32(THETA1))
    assert_stats(stats, staleness=0, median_pi=1.125, e_central=6.625, e_proxy=11.0)


def test_gem_moment_accumulates_per_worker() -> None:
    rule = gem_case()
    theta = f32(THETA0)
    rule.apply(theta, G1, theta - D1, "a", 0)
    stats = rule.apply(theta, G2, theta - D2, "a", 2)
    np.testing.assert_array_equal(rule.last_scale(), f32(PI2))
    np.testing.assert_array_equal(theta, f32(THETA2))
    assert_stats(stats, staleness=2, median_pi=0.75, e_central=3.28125, e_proxy=7.125)
    assert rule.workers == ["a"]


def test_gem_other_worker_starts_from_zero_moment() -> None:
    rule = gem_case()
    theta = f32(THETA0)
    rule.apply(theta, G1, theta - D1, "a", 0)
    rule.apply(theta, G2, theta - D2, "a", 2)
    # Worker "b" sends the first update's numbers: with a zero moment it gets exactly PI1.
    # (With a's moment [1, -1, -1.25, 0] it would get m = [1.5, -2.5, -1.125, 0.5],
    # kappa|m| = [3, 5, 2.25, 1], num = [3, 3.5, -0.75, 0.5], pi = [1.5, 1.5, 0, 1].)
    theta_b = f32(THETA0)
    stats = rule.apply(theta_b, G1, theta_b - D1, "b", 0)
    np.testing.assert_array_equal(rule.last_scale(), f32(PI1))
    np.testing.assert_array_equal(theta_b, f32(THETA1))
    assert_stats(stats, staleness=0, median_pi=1.125, e_central=6.625, e_proxy=11.0)
    assert sorted(rule.workers) == ["a", "b"]


def test_forget_resets_the_moment() -> None:
    rule = gem_case()
    theta = f32(THETA0)
    rule.apply(theta, G1, theta - D1, "a", 0)
    rule.forget("a")
    assert rule.workers == []
    rule.forget("never-seen")  # no error
    theta = f32(THETA0)
    stats = rule.apply(theta, G1, theta - D1, "a", 0)
    np.testing.assert_array_equal(rule.last_scale(), f32(PI1))
    np.testing.assert_array_equal(theta, f32(THETA1))
    assert_stats(stats, staleness=0, median_pi=1.125, e_central=6.625, e_proxy=11.0)


def test_downpour_by_hand() -> None:
    rule = Downpour(3, lr=0.5, momentum=0.5, kappa=2.0)
    theta = f32([1, 2, 3])
    # g = [2, -4, 1]  ->  delta = [-1, 2, -0.5];  theta = [0, 4, 2.5]
    # drift = [0.5, -1, 0];  delta + drift = [-0.5, 1, -0.5]  ->  e_central = 1.5 / 2 = 0.75
    # m = delta  ->  e_proxy = 1/2 * 4 * (1 + 4 + 0.25) = 10.5;  pi = 1 everywhere
    stats = rule.apply(theta, f32([2, -4, 1]), theta - f32([0.5, -1, 0]), "w", 7)
    np.testing.assert_array_equal(theta, f32([0, 4, 2.5]))
    np.testing.assert_array_equal(rule.last_scale(), f32([1, 1, 1]))
    assert_stats(stats, staleness=7, median_pi=1.0, e_central=0.75, e_proxy=10.5)
    # g = [0, 2, -1]  ->  delta = [0, -1, 0.5];  theta = [0, 3, 3]
    # m = 0.5*[-1, 2, -0.5] + delta = [-0.5, 0, 0.25]
    #   ->  e_proxy = 1/2 * 4 * (0.25 + 0 + 0.0625) = 0.625
    # drift = [1, 0, -1];  delta + drift = [1, -1, -0.5]  ->  e_central = 2.25 / 2 = 1.125
    stats = rule.apply(theta, f32([0, 2, -1]), theta - f32([1, 0, -1]), "w", 1)
    np.testing.assert_array_equal(theta, f32([0, 3, 3]))
    assert_stats(stats, staleness=1, median_pi=1.0, e_central=1.125, e_proxy=0.625)


def test_adaptive_staleness_by_hand() -> None:
    rule = AdaptiveStaleness(3, lr=0.5, momentum=0.5, kappa=1.0)
    theta = f32([1, 2, 3])
    # tau = 3  ->  pi = 1/4;  g = [2, -4, 8]  ->  delta = [-1, 2, -4];  step = [-0.25, 0.5, -1]
    # theta = [0.75, 2.5, 2];  drift = [0.25, 0, 1];  step + drift = [0, 0.5, 0]
    # e_central = 0.25 / 2 = 0.125;  e_proxy = (1 + 4 + 16) / 2 = 10.5
    stats = rule.apply(theta, f32([2, -4, 8]), theta - f32([0.25, 0, 1]), "w", 3)
    np.testing.assert_array_equal(theta, f32([0.75, 2.5, 2]))
    np.testing.assert_array_equal(rule.last_scale(), f32([0.25, 0.25, 0.25]))
    assert_stats(stats, staleness=3, median_pi=0.25, e_central=0.125, e_proxy=10.5)
    # tau = 0  ->  pi = 1;  g = [1, 1, 1]  ->  delta = [-0.5, -0.5, -0.5];  theta -= 0.5
    # drift = 0;  e_central = 3 * 0.25 / 2 = 0.375
    # m = 0.5*[-1, 2, -4] + delta = [-1, 0.5, -2.5]  ->  e_proxy = (1 + 0.25 + 6.25) / 2 = 3.75
    stats = rule.apply(theta, f32([1, 1, 1]), theta.copy(), "w", 0)
    np.testing.assert_array_equal(theta, f32([0.25, 2, 1.5]))
    assert_stats(stats, staleness=0, median_pi=1.0, e_central=0.375, e_proxy=3.75)


def test_last_scale_is_read_only() -> None:
    rule = gem_case()
    rule.apply(f32(THETA0), G1, f32(THETA0) - D1, "a", 0)
    scale = rule.last_scale()
    with pytest.raises(ValueError):
        scale[0] = 0.0


# --------------------------------------------------------------------------------------------
# Independent float64 reference on random inputs.
# --------------------------------------------------------------------------------------------

class Reference:
    """Straight from the paper (arXiv:1805.08469, eq. 27; docs/design.md, "The GEM rule"),
    in float64."""

    def __init__(self, algo: str, size: int, *, lr: float, momentum: float, kappa: float,
                 pi_max: float, eps: float) -> None:
        self.algo, self.size = algo, size
        self.lr, self.mu, self.kappa, self.pi_max, self.eps = lr, momentum, kappa, pi_max, eps
        self.m: dict[str, np.ndarray] = {}

    def apply(self, theta: np.ndarray, g: np.ndarray, drift: np.ndarray, worker: str,
              tau: int) -> tuple[np.ndarray, float, float, np.ndarray]:
        delta = -self.lr * g
        m = self.mu * self.m.get(worker, np.zeros(self.size)) + delta
        self.m[worker] = m
        if self.algo == "gem":
            pi = (self.kappa * np.abs(m) - np.abs(drift)) / (np.abs(delta) + self.eps)
            pi = np.clip(pi, 0.0, self.pi_max)
        elif self.algo == "downpour":
            pi = np.ones(self.size)
        else:
            pi = np.full(self.size, 1.0 / (tau + 1))
        theta += pi * delta
        e_central = 0.5 * np.sum((drift + pi * delta) ** 2)
        e_proxy = 0.5 * np.sum((self.kappa * m) ** 2)
        return theta, e_central, e_proxy, pi


def reference_median(pi: np.ndarray) -> float:
    if pi.size < MEDIAN_SAMPLE:
        return float(np.median(pi))
    stride = -(-pi.size // MEDIAN_SAMPLE)  # evenly spaced, at most MEDIAN_SAMPLE elements
    sample = pi[::stride]
    assert sample.size <= MEDIAN_SAMPLE
    return float(np.median(sample))


@pytest.mark.parametrize("algo", ["gem", "downpour", "adaptive"])
@pytest.mark.parametrize("size", [1000, 40000])
def test_matches_float64_reference(algo: str, size: int) -> None:
    rng = np.random.default_rng(20180522)
    config = RunConfig(run_id="ref", algo=algo, lr=0.05, momentum=0.9, kappa=2.0)
    rule = make_rule(config, size)
    ref = Reference(algo, size, lr=0.05, momentum=0.9, kappa=2.0, pi_max=5.0, eps=1e-12)
    theta = rng.normal(0.0, 1.0, size).astype(np.float32)
    theta_ref = theta.astype(np.float64)
    workers = ["w0", "w1", "w2"]
    interior = 0
    for step in range(21):
        worker = workers[step % 3] if step < 3 else workers[int(rng.integers(3))]
        tau = int(rng.integers(0, 6))
        g = (rng.normal(0.0, 1.0, size) * rng.uniform(0.1, 3.0)).astype(np.float32)
        drift = (rng.normal(0.0, 0.05, size) * rng.uniform(0.0, 3.0)).astype(np.float32)
        snapshot = theta - drift  # what the worker read, before the central variable moved
        seen = theta.astype(np.float64) - snapshot  # the drift of the float32 state, exactly
        stats = rule.apply(theta, g, snapshot, worker, tau)
        theta_ref, e_central, e_proxy, pi = ref.apply(
            theta_ref, g.astype(np.float64), seen, worker, tau)
        np.testing.assert_allclose(theta, theta_ref, rtol=1e-4, atol=1e-6)
        # pi itself is ill-conditioned where |delta| is tiny (float32 error ~ ulp * |m|/|delta|):
        # compare it weighted by |delta|, which is what reaches theta.
        weight = np.abs(-0.05 * g.astype(np.float64))
        np.testing.assert_allclose(rule.last_scale() * weight, pi * weight, rtol=1e-4, atol=1e-7)
        assert stats.staleness == tau
        assert stats.e_central == pytest.approx(e_central, rel=1e-4)
        assert stats.e_proxy == pytest.approx(e_proxy, rel=1e-4)
        assert stats.median_pi == pytest.approx(reference_median(pi), rel=1e-4, abs=1e-6)
        interior += int(np.count_nonzero((pi > 0) & (pi < 5.0)))
    if algo == "gem":  # the inputs exercise both clips and the interior
        assert interior > 0
        assert np.count_nonzero(pi == 0.0) > 0 and np.count_nonzero(pi == 5.0) > 0
    assert sorted(rule.workers) == workers


# --------------------------------------------------------------------------------------------
# Construction, in-place semantics.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("algo", "cls"), [("gem", GEM), ("downpour", Downpour),
                                          ("adaptive", AdaptiveStaleness)])
def test_make_rule_picks_the_class(algo: str, cls: type) -> None:
    config = RunConfig(run_id="r1", algo=algo, lr=0.25, momentum=0.75, kappa=3.0)
    rule = make_rule(config, 17)
    assert type(rule) is cls
    assert rule.name == algo
    assert rule.size == 17
    assert (rule.lr, rule.momentum, rule.kappa) == (0.25, 0.75, 3.0)


def test_make_rule_gem_defaults() -> None:
    rule = make_rule(RunConfig(run_id="r1"), 5)
    assert isinstance(rule, GEM)
    assert rule.pi_max == 5.0
    assert rule.eps == 1e-12
    assert (rule.lr, rule.momentum, rule.kappa) == (0.05, 0.9, 1.0)


def test_make_rule_passes_pi_max_and_eps() -> None:
    rule = make_rule(RunConfig(run_id="r1", pi_max=2.5, eps=1e-8), 5)
    assert isinstance(rule, GEM)
    assert (rule.pi_max, rule.eps) == (2.5, 1e-8)


@pytest.mark.parametrize("algo", ["gem", "downpour", "adaptive"])
def test_theta_in_place_and_gradient_untouched(algo: str) -> None:
    rule = make_rule(RunConfig(run_id="r1", algo=algo, lr=0.5, momentum=0.5, kappa=2.0,
                                 pi_max=1.5), 4)
    theta = f32(THETA0)
    theta_before = theta.copy()
    gradient = G1.copy()
    snapshot = theta - D1
    snapshot_before = snapshot.copy()
    stats = rule.apply(theta, gradient, snapshot, "a", 1)
    assert isinstance(stats, UpdateStats)
    np.testing.assert_array_equal(gradient, G1)
    np.testing.assert_array_equal(snapshot, snapshot_before)
    # apply returns no array: the update can only be seen through the caller's own object.
    expected = {"gem": f32(THETA1), "downpour": theta_before + 0.5 * -G1,
                "adaptive": theta_before + 0.5 * 0.5 * -G1}[algo]
    np.testing.assert_array_equal(theta, expected)


@pytest.mark.parametrize("size", [1, 2, 7, 8, 4096, 4097, 100_000])
def test_median_sample_is_the_median_of_its_evenly_spaced_sample(size: int) -> None:
    values = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    assert median_sample(values) == pytest.approx(reference_median(values), rel=1e-6)
    stride = -(-size // 64)
    assert median_sample(values, 64) == pytest.approx(float(np.median(values[::stride])),
                                                      rel=1e-6)


def test_median_sample_of_nothing_is_nan() -> None:
    assert np.isnan(median_sample(np.empty(0, np.float32)))


# --- buffers: moving averages applied to the run's current value -------------------------

#: A BatchNorm-like buffer part after 3 parameters: running mean (4), running variance (4),
#: both with momentum 0.1, and a batch count (momentum 0: its change is added).
BN_MOMENTUM = 0.1
BN_MOMENTA = f32([BN_MOMENTUM] * 8 + [0.0])


def _bn_change(snapshot: np.ndarray, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """What a worker that read ``snapshot`` sends for its buffers: BatchNorm's step
    v = (1 - m) s + m b computed in float32 (as torch does), minus s; the count moves by 1."""
    m = np.float32(BN_MOMENTUM)
    s = snapshot[3:]
    stepped = np.concatenate([(1 - m) * s[:8] + m * np.concatenate([mean, var]),
                              s[8:] + 1]).astype(np.float32)
    return np.concatenate([f32([0.01, -0.02, 0.03]), stepped - s])


@pytest.mark.parametrize("algo", ["gem", "downpour", "adaptive", "dcasgd"])
def test_stale_moving_average_changes_land_as_the_sequential_average(algo: str) -> None:
    """Workers computing on stale copies: the run's running statistics are exactly the
    EMA of the batches' statistics applied in arrival order to its own value, and the
    variance stays positive where adding the changes would drive it below 0."""
    rng = np.random.default_rng(3)
    rule = make_rule(RunConfig(run_id="r", algo=algo), 3, buffer_momenta=BN_MOMENTA)
    theta = f32([0.5, -0.5, 1.0, 0, 0, 0, 0, 1, 1, 1, 1, 0])  # params, mean 0, var 1, count
    versions = [theta.copy()]
    reference = theta[3:11].astype(np.float64)  # the sequential EMA, in float64
    naive = theta[3:].astype(np.float64)  # what adding every change gives
    updates = 24
    for i in range(updates):
        # Most workers read version 0 (up to 23 updates stale); a few read a fresh copy.
        version = 0 if i % 6 else len(versions) - 1
        snapshot = versions[version]
        mean = rng.normal(3.0, 0.2, 4).astype(np.float32)
        var = rng.uniform(0.005, 0.02, 4).astype(np.float32)  # batches far below var 1
        change = _bn_change(snapshot, mean, var)
        rule.apply(theta, change, snapshot, f"w{i % 5}", len(versions) - 1 - version)
        reference = (1 - BN_MOMENTUM) * reference + BN_MOMENTUM * np.concatenate([mean, var])
        naive += change[3:]
        versions.append(theta.copy())
    np.testing.assert_allclose(theta[3:11], reference, rtol=2e-5, atol=1e-6)
    assert theta[11] == updates  # the batch count: every change added
    assert (theta[7:11] > 0).all()
    assert (naive[4:8] < 0).all()  # the old rule's overshoot, for contrast
    assert np.abs(naive[:4] - reference[:4]).min() > 1.0


def test_buffer_changes_without_momenta_are_added_as_they_are() -> None:
    rule = make_rule(RunConfig(run_id="r"), 2, buffer_momenta=f32([0.0, 0.5]))
    theta, snapshot = f32([0, 0, 10, 10]), f32([0, 0, 4, 4])
    rule.apply(theta, f32([0, 0, 2, 2]), snapshot, "w", 3)
    np.testing.assert_array_equal(theta[2:], [12, 12 - 0.5 * (10 - 4)])
    with pytest.raises(ValueError, match="3 buffer elements after the parameters"):
        rule.apply(f32([0, 0, 1, 1, 1]), f32([0] * 5), f32([0] * 5), "w", 0)
