"""``gemq simulate``: the simulator (gemq/simulator.py) on the command line.

Importing this module is light (no torch): the CLI imports it for every command, and
``gemq aggregator`` must start without torch. The simulator is imported when the command runs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from gemq.config import DCASGD_LAMBDA, PROXIES, RunConfig
from gemq.staleness import STALENESS_KINDS, StalenessModel

MAX_WORKERS = 100_000  # gemq.simulator.MAX_WORKERS, repeated here to keep torch out


def _workers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_WORKERS}], got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_simulate_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to the ``gemq`` subcommands (``commands``: argparse subparsers)."""
    from gemq.cli import _add_training, _positive_int

    parser: argparse.ArgumentParser = commands.add_parser(
        "simulate", help="research mode: n workers simulated in one process, no Redis, "
                         "deterministic (same seed, same curves)")
    _add_training(parser)
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--workers", type=_workers, default=4,
                     help=f"simulated workers, 1 to {MAX_WORKERS:,}")
    sim.add_argument("--staleness", choices=STALENESS_KINDS, default="round-robin",
                     help="round-robin: every update n-1 stale; random: gamma-distributed "
                          "compute times; heterogeneous: some workers slower")
    sim.add_argument("--time-cv", type=_non_negative, default=0.5,
                     help="coefficient of variation of compute times (random, heterogeneous)")
    sim.add_argument("--slow-fraction", type=_non_negative, default=0.25,
                     help="share of slow workers (heterogeneous)")
    sim.add_argument("--slow-factor", type=_non_negative, default=4.0,
                     help="how many times slower a slow worker is (heterogeneous)")
    sim.add_argument("--proxy", choices=PROXIES, default="local",
                     help="GEM's proxy: per worker (local) or from all updates (global)")
    sim.add_argument("--dcasgd-lambda", type=_non_negative, default=DCASGD_LAMBDA,
                     help="lambda of --algo dcasgd")
    sim.add_argument("--reference", action="store_true",
                     help="run the momentum-SGD proxy (one synchronous worker) instead")
    sim.add_argument("--eval-every", type=_positive_int, default=None,
                     help="central updates between curve points (default: budget / 20)")
    sim.add_argument("--eval-samples", type=_positive_int, default=1000,
                     help="training and test samples evaluated at each curve point")
    sim.add_argument("--out", type=Path, default=None,
                     help="write the curves here: .json (everything) or .csv (the curve)")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _config(args: argparse.Namespace, budget: int) -> RunConfig:
    return RunConfig.from_dict({
        "run_id": args.run_id or "sim", "algo": args.algo, "lr": args.lr,
        "momentum": args.momentum, "kappa": args.kappa, "pi_max": args.pi_max,
        "proxy": args.proxy, "batch_size": args.batch_size, "budget_updates": budget,
        "model": args.model, "dataset": args.dataset, "seed": args.seed,
        "max_staleness": args.max_staleness})


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run one simulation; print its summary; write the curves to ``--out``."""
    from gemq.data import load_dataset
    from gemq.runs import budget_for
    from gemq.simresults import check_output_path, write_result
    from gemq.simulator import SimOptions, simulate

    if args.out is not None:
        check_output_path(args.out)  # before the work, not after it
    staleness = StalenessModel(args.staleness, time_cv=args.time_cv,
                               slow_fraction=args.slow_fraction, slow_factor=args.slow_factor)
    options = SimOptions(workers=args.workers, staleness=staleness,
                         eval_every=args.eval_every or 0, eval_samples=args.eval_samples,
                         dcasgd_lambda=args.dcasgd_lambda, reference=args.reference)
    _config(args, 1)  # validate every flag before loading data
    data = load_dataset(args.dataset)
    budget = args.steps or budget_for(args.epochs or 10, data, args.batch_size)
    result = simulate(_config(args, budget), options, data=data,
                      progress=not args.no_progress)
    _print_summary(result.summary)
    if args.out is not None:
        print(f"curves:  {write_result(result, args.out)}")
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    state = "DIVERGED" if s["diverged"] else "finished"
    print(f"{s['algo']} with {s['workers']} simulated workers {state}: train loss "
          f"{s['initial_train_loss']:.4f} -> {s['train_loss']:.4f}, test accuracy "
          f"{100 * s['test_accuracy']:.1f}%")
    print(f"updates: {s['updates']} applied, {s['rejected']} rejected; mean staleness "
          f"{s['staleness_mean']:.1f}, energy ratio {s['energy_ratio']:.2f}, median pi "
          f"{s['median_pi']:.3f}; {s['gradients_per_s']:.0f} gradients/s, "
          f"{s['wall_s']:.1f}s")

