"""The simulator (gemq/sim/: engine, staleness models, command) and the rules it
added to gemq/aggregation/rules.py (DC-ASGD, GEM with a global proxy)."""

from __future__ import annotations

import csv
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from gemq import cli
from gemq.aggregation.rules import DCASGD, GEM, GlobalGEM, make_rule
from gemq.config import RunConfig
from gemq.errors import ConfigError, GemqError
from gemq.sim.command import add_simulate_parser, cmd_simulate
from gemq.sim.engine import Simulator, simulate
from gemq.sim.options import SimOptions
from gemq.sim.results import SimResult
from gemq.sim.staleness import Schedule, StalenessModel
from gemq.training.data import DataSplit, load_dataset


@pytest.fixture(scope="module")
def digits() -> DataSplit:
    return load_dataset("digits")


@pytest.fixture(scope="module")
def mnist() -> DataSplit:
    return load_dataset("mnist5k")


def small(algo: str = "gem", **changes: object) -> RunConfig:
    """Logistic regression on the 8x8 digits: a step costs microseconds."""
    settings: dict[str, object] = {"run_id": "t", "algo": algo, "model": "logreg",
                                   "dataset": "digits", "budget_updates": 60, **changes}
    return RunConfig.from_dict(settings)


def cnn(algo: str = "gem", **changes: object) -> RunConfig:
    """The paper's CNN on mnist5k (~8 ms a gradient on one core)."""
    return RunConfig.from_dict({"run_id": "t", "algo": algo, **changes})


def comparable(result: SimResult) -> str:
    """Everything a run recorded except how long it took."""
    data = result.to_dict()
    for timing in ("wall_s", "eval_s", "gradients_per_s", "gradients_per_cpu_s"):
        data["summary"].pop(timing)
    return json.dumps(data, sort_keys=True)


# --- staleness models ---------------------------------------------------------------------


def test_round_robin_schedule_is_cyclic() -> None:
    schedule = Schedule(StalenessModel("round-robin"), 7, seed=3)
    order = []
    for _ in range(5 * 7):
        worker = schedule.next()
        order.append(worker)
        schedule.start(worker)
    assert order == list(range(7)) * 5


def test_heterogeneous_slow_workers_commit_less_often() -> None:
    model = StalenessModel("heterogeneous", time_cv=0.0, slow_fraction=0.25, slow_factor=4)
    schedule = Schedule(model, 8, seed=0)
    counts = [0] * 8
    for _ in range(8 * 100):
        worker = schedule.next()
        counts[worker] += 1
        schedule.start(worker)
    assert counts[0] == counts[1] and counts[2:] == [counts[2]] * 6  # 2 slow, 6 fast
    assert counts[2] / counts[0] == pytest.approx(4, rel=0.05)


@pytest.mark.parametrize(("changes", "field"), [
    ({"kind": "fifo"}, "staleness"), ({"time_cv": -1.0}, "time_cv"),
    ({"slow_fraction": 1.5}, "slow_fraction"), ({"slow_factor": 0.5}, "slow_factor"),
    ({"time_cv": math.nan}, "time_cv")])
def test_staleness_model_validates(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        StalenessModel(**changes)  # type: ignore[arg-type]
    assert info.value.field == field


def test_round_robin_staleness_is_exactly_n_minus_1_after_warm_up(digits: DataSplit) -> None:
    n = 6
    result = simulate(small(budget_updates=10 * n), SimOptions(workers=n, eval_every=n),
                      data=digits)
    warm_up, *steady = result.curve[1:]  # curve[0] is before any update
    assert (warm_up["staleness_min"], warm_up["staleness_max"]) == (0, n - 1)
    assert len(steady) == 9
    assert all(row["staleness_min"] == row["staleness_max"] == n - 1 for row in steady)


def test_random_staleness_varies_and_is_bounded(digits: DataSplit) -> None:
    config = small(budget_updates=400, max_staleness=10)
    options = SimOptions(workers=8, staleness=StalenessModel("random", time_cv=1.0))
    result = simulate(config, options, data=digits)
    s = result.summary
    assert s["updates"] == 400 and s["rejected"] > 0  # some waited more than 10 updates
    assert s["gradients"] == s["updates"] + s["rejected"]
    assert s["staleness_max"] <= 10
    assert s["snapshots_peak"] <= 8  # at most one version per worker


def test_snapshots_are_bounded_by_max_staleness_not_by_n(digits: DataSplit) -> None:
    # 28 of 30 workers are 100 times slower: their versions outlive max_staleness = 5 and are
    # dropped (their gradients are rejected when they land), so at most 6 are ever kept.
    model = StalenessModel("heterogeneous", time_cv=0.0, slow_fraction=28 / 30,
                           slow_factor=100)
    result = simulate(small(budget_updates=400, max_staleness=5),
                      SimOptions(workers=30, staleness=model), data=digits)
    assert result.summary["rejected"] == 56  # each slow worker landed twice, too late
    assert result.summary["snapshots_peak"] <= 6


def test_round_robin_beyond_max_staleness_is_refused(digits: DataSplit) -> None:
    with pytest.raises(ConfigError, match="max_staleness"):
        simulate(small(max_staleness=8), SimOptions(workers=10), data=digits)


def test_mostly_rejected_stops_with_an_error(digits: DataSplit) -> None:
    # 20 workers, none allowed to be stale: only a worker that commits twice in a row gets
    # a gradient in, so rejections outnumber the budget long before it is spent.
    options = SimOptions(workers=20, staleness=StalenessModel("random"))
    with pytest.raises(GemqError, match="raise --max-staleness"):
        simulate(small(max_staleness=0), options, data=digits)


# --- determinism, scale ------------------------------------------------------------------


def test_same_seed_gives_bit_identical_curves(mnist: DataSplit) -> None:
    """The CNN (dropout, convolutions) under random staleness: every source of randomness."""
    config = cnn(budget_updates=40)
    options = SimOptions(workers=4, staleness=StalenessModel("random"), eval_every=10,
                         eval_samples=200, pi_every=5)
    first, second = (simulate(config, options, data=mnist) for _ in range(2))
    assert comparable(first) == comparable(second)
    assert first.theta.tobytes() == second.theta.tobytes()
    other = simulate(config.replace(seed=1), options, data=mnist)
    assert other.curve[-1]["train_loss"] != first.curve[-1]["train_loss"]


def test_simulation_leaves_torch_settings_alone(digits: DataSplit) -> None:
    import torch

    threads, state = torch.get_num_threads(), torch.get_rng_state()
    simulate(small(budget_updates=5), SimOptions(workers=2), data=digits)
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.equal(torch.get_rng_state(), state)


def test_a_thousand_workers(digits: DataSplit) -> None:
    config = small(budget_updates=1500, max_staleness=1000)
    result = simulate(config, SimOptions(workers=1000, eval_every=500), data=digits)
    assert result.summary["updates"] == 1500
    assert result.curve[-1]["staleness_min"] == result.curve[-1]["staleness_max"] == 999
    assert result.summary["snapshots_peak"] == 1000


def _seconds_per_gradient(digits: DataSplit, workers: int) -> float:
    config = small(budget_updates=workers + 1000, max_staleness=workers)
    options = SimOptions(workers=workers, eval_every=workers + 1000)
    started = time.perf_counter()
    simulate(config, options, data=digits)
    return (time.perf_counter() - started) / (workers + 1000)


def test_cost_per_gradient_does_not_grow_with_n(digits: DataSplit) -> None:
    """Logistic regression: the step is so cheap that per-worker overhead would show."""
    few = min(_seconds_per_gradient(digits, 5) for _ in range(2))
    many = min(_seconds_per_gradient(digits, 500) for _ in range(2))
    assert many < 2.0 * few, (many, few)


# --- the paper's claims, short versions ----------------------------------------------------


def test_n1_gem_without_momentum_is_the_proxy(mnist: DataSplit) -> None:
    """n = 1, mu = 0: the worker's moment is its own delta and theta - s = 0, so
    pi = |delta| / (|delta| + 1e-12), which is 1 in float32 wherever |delta| > ~2e-5: GEM is
    plain SGD, the proxy. The two trajectories differ only by that rounding, so over 50
    steps of the CNN the losses agree to 1e-3 and the parameters to 1e-4."""
    config = cnn(budget_updates=50, momentum=0.0)
    options = SimOptions(workers=1, eval_every=10, eval_samples=500)
    gem = simulate(config, options, data=mnist)
    proxy = simulate(config, SimOptions(workers=1, eval_every=10, eval_samples=500,
                                        reference=True), data=mnist)
    for ours, theirs in zip(gem.curve, proxy.curve, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-3)
    assert np.max(np.abs(gem.theta - proxy.theta)) < 1e-4


def test_n1_gem_with_momentum_tracks_the_proxy(mnist: DataSplit) -> None:
    """n = 1, mu = 0.9: theta - s = 0, so GEM steps pi delta with pi = kappa |m| / |delta|
    clipped to [0, pi_max]: per element the proxy's step size |m| (unless clipped at
    5 |delta|) in the direction of the current gradient, where the proxy steps m itself.
    Not the same trajectory, then, but never more energy than the proxy (the energy ratio is
    at most 1 on every update) and the same speed of descent: over 200 steps (3 epochs of
    data) GEM's mean training loss at the evaluations (the area under its loss curve) is
    within a factor 1.5 of the proxy's. One evaluation alone is too noisy to compare: with
    momentum the proxy's loss can jump by half in 20 steps (0.126 to 0.192 at the last
    evaluation, on one machine), which put the two final losses a factor 1.52 apart."""
    config = cnn(budget_updates=200)
    gem = simulate(config, SimOptions(workers=1, eval_every=20, eval_samples=500),
                   data=mnist)
    proxy = simulate(config, SimOptions(workers=1, eval_every=20, eval_samples=500,
                                        reference=True), data=mnist)
    assert all(row["energy_ratio"] <= 1 + 1e-6 for row in gem.curve[1:])
    ours, theirs = (np.mean([row["train_loss"] for row in run.curve[1:]])
                    for run in (gem, proxy))
    assert theirs / 1.5 <= ours <= 1.5 * theirs
    assert gem.summary["train_loss"] < 0.25 * gem.summary["initial_train_loss"]


@pytest.mark.slow
def test_figure1_gem_is_stable_in_n(mnist: DataSplit) -> None:
    """Figure 1, short: one epoch of data per worker (62 steps: 62 n updates). At n = 30
    GEM does not diverge, and its final loss is within a factor 2 of its n = 5 loss."""
    finals = {}
    for n in (5, 30):
        config = cnn(budget_updates=62 * n)
        options = SimOptions(workers=n, eval_every=31 * n, eval_samples=1000)
        summary = simulate(config, options, data=mnist).summary
        assert not summary["diverged"], summary
        finals[n] = summary["train_loss"]
    assert math.isfinite(finals[30]) and finals[30] <= 2.0 * finals[5], finals


@pytest.mark.slow
def test_figure6_gem_beats_downpour_at_a_misspecified_learning_rate(mnist: DataSplit) -> None:
    """Figure 6, short: eta = 0.1, n = 10, one epoch of data per worker (620 updates)."""
    finals = {}
    for algo in ("gem", "downpour"):
        config = cnn(algo, lr=0.1, budget_updates=620)
        result = simulate(config, SimOptions(workers=10, eval_every=310), data=mnist)
        finals[algo] = result.summary["train_loss"]
    assert finals["gem"] < finals["downpour"], finals


# --- the new rules --------------------------------------------------------------------------


def f32(values: Sequence[float]) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_dcasgd_by_hand() -> None:
    # lr = 0.5, lambda = 2, g = [2, -4, 1], theta - s = [0.5, -1, 0]
    # g + lambda g g drift = [2 + 2*4*0.5, -4 + 2*16*(-1), 1 + 0] = [6, -36, 1]
    # step = -0.5 [6, -36, 1] = [-3, 18, -0.5];  pi = step / delta = [3, 9, 1]
    rule = DCASGD(3, lr=0.5, momentum=0.5, lam=2.0)
    theta = f32([1, 2, 3])
    stats = rule.apply(theta, f32([2, -4, 1]), theta - f32([0.5, -1, 0]), "w", 4)
    np.testing.assert_array_equal(theta, f32([-2, 20, 2.5]))
    np.testing.assert_array_equal(rule.last_scale(), f32([3, 9, 1]))
    assert stats.median_pi == 3.0 and stats.staleness == 4


def test_dcasgd_without_drift_is_downpour() -> None:
    rule = DCASGD(3, lr=0.5, momentum=0.5, lam=7.0)
    theta = f32([1, 2, 3])
    rule.apply(theta, f32([2, -4, 1]), theta.copy(), "w", 0)
    np.testing.assert_array_equal(theta, f32([0, 4, 2.5]))


def test_global_proxy_shares_one_moment() -> None:
    # Local GEM: b's first update sees a zero moment. Global: the moment already holds a's
    # delta. lr = 1, mu = 0.5, g_a = [-1, -1], g_b = [-1, 1], no drift:
    #   global m = 0.5 [1, 1] + [1, -1] = [1.5, -0.5];  pi = clip(|m| / |delta|, 0, 5)
    #   = [1.5, 0.5];  theta_b = [1.5, -0.5]
    local, shared = GEM(2, lr=1, momentum=0.5), GlobalGEM(2, lr=1, momentum=0.5)
    read = f32([0, 0])  # every worker read theta = [0, 0]: no drift
    for rule in (local, shared):
        rule.apply(f32([0, 0]), f32([-1, -1]), read, "a", 0)
    theta_local, theta_shared = f32([0, 0]), f32([0, 0])
    local.apply(theta_local, f32([-1, 1]), read, "b", 0)
    shared.apply(theta_shared, f32([-1, 1]), read, "b", 0)
    np.testing.assert_array_equal(theta_local, f32([1, -1]))
    np.testing.assert_array_equal(theta_shared, f32([1.5, -0.5]))
    assert shared.workers == ["a", "b"]
    shared.forget("a")
    assert shared.workers == ["b"]


def test_make_rule_new_rules() -> None:
    assert type(make_rule(RunConfig("r", proxy="global"), 4)) is GlobalGEM
    rule = make_rule(RunConfig("r", algo="dcasgd"), 4, dcasgd_lambda=0.25)
    assert isinstance(rule, DCASGD) and rule.lam == 0.25
    with pytest.raises(ConfigError, match="proxy"):
        make_rule(RunConfig("r", algo="downpour", proxy="global"), 4)
    with pytest.raises(ConfigError, match="dcasgd_lambda"):
        make_rule(RunConfig("r", algo="dcasgd"), 4, dcasgd_lambda=-1.0)


# --- gemq simulate ---------------------------------------------------------------------------


def _standalone_main(argv: list[str]) -> int:
    """cli.main's error handling, for a cli.py where `simulate` is not registered yet."""
    parser = cli._Parser(prog="gemq")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=cli._Parser)
    add_simulate_parser(commands)
    try:
        return cmd_simulate(parser.parse_args(argv))
    except ConfigError as e:
        print(f"gemq: error: {e}", file=sys.stderr)
        return cli.EXIT_USAGE
    except GemqError as e:
        print(f"gemq: error: {e}", file=sys.stderr)
        return 1


def gemq(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    main = cli.main if "simulate" in cli.COMMANDS else _standalone_main
    capsys.readouterr()
    try:
        code = main(["simulate", "--model", "logreg", "--dataset", "digits", "--no-progress",
                     *args])
    except SystemExit as e:  # argparse refuses a flag
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_json_and_csv(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for suffix in ("json", "csv"):
        out = tmp_path / f"curves.{suffix}"
        code, stdout, _ = gemq(capsys, "--workers", "3", "--steps", "30", "--eval-every",
                               "10", "--staleness", "random", "--out", str(out))
        assert code == 0
        assert "gem with 3 simulated workers finished" in stdout
    data = json.loads((tmp_path / "curves.json").read_text())
    assert data["simulation"]["staleness"]["kind"] == "random"
    assert [row["updates"] for row in data["curve"]] == [0, 10, 20, 30]
    with (tmp_path / "curves.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["updates"]) for r in rows] == [0, 10, 20, 30]
    assert [r["train_loss"] for r in rows] == [str(r["train_loss"]) for r in data["curve"]]


@pytest.mark.parametrize(("args", "message"), [
    (["--workers", "0"], "--workers"),
    (["--staleness", "fifo"], "--staleness"),
    (["--out", "curves.txt"], "--out"),
    (["--workers", "600"], "max_staleness"),
    (["--algo", "downpour", "--proxy", "global"], "proxy"),
    (["--staleness", "heterogeneous", "--slow-factor", "0.5"], "slow_factor"),
    (["--lr", "-1"], "lr"),
])
def test_cli_bad_flags_get_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                                    message: str) -> None:
    code, _, err = gemq(capsys, "--steps", "5", *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err


# --- buffers -----------------------------------------------------------------------------

BN_MODELS = """
from torch import nn

def bn_mlp():
    return nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
"""


def test_running_statistics_stay_true_under_heavy_staleness(
        digits: DataSplit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """32 workers in round robin, each on a copy 31 updates old: adding their changes to
    BatchNorm's running statistics would give each batch 32 times its momentum (3.2, an
    unstable average whose variance goes below 0); applied to the run's value they stay
    the batches' running average."""
    (tmp_path / "bnsim.py").write_text(BN_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small("downpour", model="bnsim:bn_mlp", budget_updates=32 * 8, lr=0.001)
    sim = Simulator(config, SimOptions(workers=32, eval_every=32 * 8), data=digits)
    sim.run()
    where = {t.name: t.slice for t in sim.layout.buffers}
    running_var = sim.theta[where["1.running_var"]]
    with torch.no_grad():  # the statistic the running variance averages, at the end
        sim.net.load(sim.theta)
        x = torch.stack([digits.train[i][0] for i in range(512)])
        batch_var = sim.net.model[0](x).var(0).numpy()
    assert (running_var > 0).all()
    np.testing.assert_allclose(running_var, batch_var, rtol=0.5)
    assert sim.theta[where["1.num_batches_tracked"]].tolist() == [32 * 8]


def test_a_budget_of_a_few_updates_per_worker_says_how_epochs_count(
        capsys: pytest.CaptureFixture[str]) -> None:
    """One epoch is one pass over the training set by all workers together: with many workers
    that is a short run, and gemq says so before it starts."""
    code, _, err = gemq(capsys, "--workers", "10", "--epochs", "1")
    assert code == 0
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, err
    assert re.fullmatch(r"note: \d+ updates in all, \d\.\d per worker for 10 workers \(epochs "
                        r"count passes over the training set by all workers together\); for "
                        r"a longer run raise --epochs or give --steps", notes[0]), notes[0]
    code, _, err = gemq(capsys, "--workers", "3", "--steps", "30")  # 10 each: no note
    assert code == 0 and "note:" not in err
