"""``gemq simulate``: the simulation engine on the command line.

Importing this module is light (no torch): the CLI imports it for every command, and
``gemq aggregator`` must start without torch. The engine is imported when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gemq.cliargs import add_settings, non_negative, positive_int, settings_of
from gemq.config import (
    BUDGET,
    DCASGD_LAMBDA,
    TRAINING,
    make_config,
    short_budget_note,
    validate_settings,
)
from gemq.sim.options import MAX_WORKERS, SimOptions
from gemq.sim.staleness import STALENESS_KINDS, StalenessModel

#: The setting groups a simulation uses: how gradients travel is not simulated.
GROUPS = (TRAINING, BUDGET)


def _workers(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_WORKERS}], got {value}")
    return value


def add_simulate_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to the ``gemq`` subcommands (``commands``: argparse subparsers)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "simulate", help="research mode: n workers simulated in one process, no Redis, "
                         "deterministic (same seed, same curves)",
        description="Simulate n asynchronous workers in one process, through the "
                    "aggregator's own rule code, under a staleness model.",
        epilog="example:\n  gemq simulate --workers 100 --staleness round-robin "
               "--epochs 1 --out curves.json")
    add_settings(parser, GROUPS)
    parser.add_argument("--run", dest="run_id", default="sim", help="name of the simulated run")
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--workers", type=_workers, default=4,
                     help=f"simulated workers, 1 to {MAX_WORKERS:,}")
    sim.add_argument("--staleness", choices=STALENESS_KINDS, default="round-robin",
                     help="round-robin: every update n-1 stale; random: gamma-distributed "
                          "compute times; heterogeneous: some workers slower")
    sim.add_argument("--time-cv", type=non_negative, default=0.5,
                     help="coefficient of variation of compute times (random, heterogeneous)")
    sim.add_argument("--slow-fraction", type=non_negative, default=0.25,
                     help="share of slow workers (heterogeneous)")
    sim.add_argument("--slow-factor", type=non_negative, default=4.0,
                     help="how many times slower a slow worker is (heterogeneous)")
    sim.add_argument("--dcasgd-lambda", type=non_negative, default=DCASGD_LAMBDA,
                     help="lambda of --algo dcasgd")
    sim.add_argument("--reference", action="store_true",
                     help="run the proxy itself (momentum SGD or Adam: --optimizer; one "
                          "synchronous worker) instead")
    sim.add_argument("--eval-every", type=positive_int, default=None,
                     help="central updates between curve points (default: budget / 20)")
    sim.add_argument("--eval-samples", type=positive_int, default=1000,
                     help="training and test samples evaluated at each curve point")
    sim.add_argument("--out", type=Path, default=None,
                     help="write the curves here: .json (everything) or .csv (the curve)")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run one simulation; print its summary; write the curves to ``--out``."""
    from gemq.sim.engine import simulate
    from gemq.sim.results import check_output_path, write_result
    from gemq.training.data import load_dataset

    if args.out is not None:
        check_output_path(args.out)  # before the work, not after it
    staleness = StalenessModel(args.staleness, time_cv=args.time_cv,
                               slow_fraction=args.slow_fraction, slow_factor=args.slow_factor)
    options = SimOptions(workers=args.workers, staleness=staleness,
                         eval_every=args.eval_every or 0, eval_samples=args.eval_samples,
                         dcasgd_lambda=args.dcasgd_lambda, reference=args.reference)
    settings = {**settings_of(args, GROUPS), "run_id": args.run_id}
    validate_settings(settings)  # every flag, before loading data
    data = load_dataset(args.dataset)
    config = make_config(settings, train_samples=len(data.train))  # type: ignore[arg-type]
    result = simulate(config, options, data=data, progress=not args.no_progress)
    _print_summary(result.summary)
    # After the run: a setting the simulator refuses is then the one line its error is.
    note = None if options.reference else short_budget_note(config, options.workers)
    if note:
        print(note, file=sys.stderr, flush=True)
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
