"""Regenerate the GEM paper's MNIST experiments with the simulator, into docs/results/.

    python -m benchmarks.paper            # the full set: paper CNN, mnist5k, 3 seeds
    python -m benchmarks.paper --quick    # a smoke test of the whole pipeline, seconds

Every run is ``gemq.sim.engine.simulate`` (the aggregator's own rule objects) under the
round-robin staleness model: every update is exactly n-1 updates stale, the paper's expected
case. Each setting runs once per seed; figures show the mean and the min-max band, the table
the mean and the range. Budgets follow the paper: each worker contributes one epoch of data
(62 steps of 64 samples over the 4,000 training samples), so n workers make 62 n updates.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from benchmarks import paper_figures as figures
from benchmarks.paper_plan import (
    ADAPTIVE,
    BEYOND,
    DCASGD,
    DOWNPOUR,
    GEM,
    GLOBAL,
    PROXY,
    Plan,
    Setting,
)
from gemq.config import RunConfig
from gemq.sim.engine import deterministic_torch, simulate
from gemq.sim.options import SimOptions
from gemq.sim.results import SimResult
from gemq.training.data import DataSplit, load_dataset, minibatches, worker_seed
from gemq.training.models import build_model

FULL = Plan()
QUICK = Plan(ns=(2, 4), n_large=8, steps_per_worker=4, seeds=(0, 1), n_lr=3, n_kappa=3,
             points=4, pi_every=2, model="logreg", dataset="digits", eval_samples=200,
             n_heatmap=4, bench_workers=(2, 8, 50), bench_updates=100, bench_rounds=1)
DEFAULT_OUT = Path("docs/results")

Runs = dict[Setting, list[SimResult]]


def figure_settings(plan: Plan) -> dict[str, list[Setting]]:
    """Which settings each figure shows (one setting may serve several figures)."""
    per, ns = plan.steps_per_worker, plan.ns
    longest = per * max(ns)
    sweep = [Setting(v, n, per * n) for v in (GEM, DOWNPOUR, ADAPTIVE) for n in ns]
    beyond = [Setting(v, n, per * n) for v in BEYOND for n in ns]
    large = Setting(GEM, plan.n_large, per * plan.n_large)
    fig6 = [Setting(v, plan.n_lr, per * plan.n_lr, lr=0.1)
            for v in (GEM, DOWNPOUR, GLOBAL, DCASGD)]
    fig6.append(Setting(PROXY, 1, per * plan.n_lr, lr=0.1))
    fig8 = [Setting(GEM, plan.n_kappa, per * plan.n_kappa, kappa=k) for k in plan.kappas]
    proxy = Setting(PROXY, 1, longest)
    return {"fig1": [*sweep, proxy], "beyond": [*beyond, *sweep, proxy],
            "fig2": [large, Setting(GEM, max(ns), longest), proxy],
            "fig3": [s for s in sweep if s.variant == GEM] + [large],
            "fig6": fig6, "fig8": fig8, "heatmap": [Setting(GEM, plan.n_heatmap,
                                                            per * plan.n_heatmap)]}


def run_config(plan: Plan, setting: Setting, seed: int) -> RunConfig:
    v = setting.variant
    return RunConfig(run_id="paper", algo=v.algo, proxy=v.proxy, lr=setting.lr,
                     momentum=0.9, kappa=setting.kappa, batch_size=64,
                     budget_updates=setting.updates, model=plan.model, dataset=plan.dataset,
                     seed=seed, max_staleness=max(512, setting.workers))


def run_options(plan: Plan, setting: Setting) -> SimOptions:
    return SimOptions(workers=setting.workers, reference=setting.variant.reference,
                      eval_every=max(1, setting.updates // plan.points),
                      eval_samples=plan.eval_samples, pi_every=plan.pi_every)


def run_all(plan: Plan, data: DataSplit, settings: Sequence[Setting]) -> Runs:
    """Every setting once per seed, one at a time (one heavy process, one thread)."""
    total = sum(s.updates for s in settings) * len(plan.seeds)
    runs: Runs = {}
    with tqdm(total=total, unit="upd", dynamic_ncols=True, desc="paper") as bar:
        for setting in settings:
            bar.set_postfix_str(f"{setting.variant.label} n={setting.workers} "
                                f"lr={setting.lr} kappa={setting.kappa}", refresh=True)
            runs[setting] = [_run_one(plan, data, setting, seed, bar) for seed in plan.seeds]
    return runs


def _run_one(plan: Plan, data: DataSplit, setting: Setting, seed: int, bar: tqdm) -> SimResult:
    result = simulate(run_config(plan, setting, seed), run_options(plan, setting), data=data,
                      on_updates=lambda count, _row: bar.update(count))
    bar.update(setting.updates - result.summary["updates"])  # a diverged run stops early
    return result


def plain_loop_rate(plan: Plan, data: DataSplit, steps: int) -> tuple[float, float]:
    """Gradient steps per second (wall, CPU) of a plain single-process momentum-SGD loop
    on the same model, data and batch: what the simulator's overhead is measured against."""
    with deterministic_torch():
        torch.manual_seed(0)
        model = build_model(plan.model, data.in_features, data.num_classes).train()
        optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        batches = minibatches(data.train, 64, worker_seed(0, "plain"))
        for i in range(steps + 20):  # 20 steps of warm-up, not timed
            if i == 20:
                started, cpu = time.perf_counter(), time.process_time()
            x, y = next(batches)
            optimiser.zero_grad(set_to_none=True)
            torch.nn.functional.nll_loss(model(x), y).backward()
            optimiser.step()
        return (steps / (time.perf_counter() - started),
                steps / (time.process_time() - cpu))


def speed(plan: Plan, data: DataSplit) -> dict[str, Any]:
    """Simulator gradients/s (evaluation excluded) for each n, against the plain loop.

    Each is measured ``plan.bench_rounds`` times, interleaved, and the best kept, in wall
    time and in CPU time: on a machine shared with other work the CPU time of this one
    thread is the steadier measure of the cost, and the best of a few the closest to it.
    """
    plain = [plain_loop_rate(plan, data, plan.bench_updates)]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in plan.bench_workers}
    for round_ in range(plan.bench_rounds):
        if round_:
            plain.append(plain_loop_rate(plan, data, plan.bench_updates))
        for n in plan.bench_workers:
            runs[n].append(_bench_run(plan, data, n))
    wall, cpu = max(p[0] for p in plain), max(p[1] for p in plain)
    rows = []
    for n, summaries in runs.items():
        best_wall = max(s["gradients_per_s"] for s in summaries)
        best_cpu = max(s["gradients_per_cpu_s"] for s in summaries)
        rows.append({"workers": n, "gradients_per_s": best_wall, "ratio": best_wall / wall,
                     "gradients_per_cpu_s": best_cpu, "cpu_ratio": best_cpu / cpu,
                     "snapshots_peak": summaries[-1]["snapshots_peak"]})
    return {"plain_loop_steps_per_s": wall, "plain_loop_steps_per_cpu_s": cpu,
            "plain_loop_rounds": plain, "simulator": rows}


def _bench_run(plan: Plan, data: DataSplit, workers: int) -> dict[str, Any]:
    # Every worker commits once before the timed part ends: all of them hold state.
    setting = Setting(GEM, workers, workers + plan.bench_updates)
    options = replace(run_options(plan, setting), eval_every=setting.updates)
    return simulate(run_config(plan, setting, 0), options, data=data).summary


SUMMARY_FIELDS = ("train_loss", "test_accuracy", "initial_train_loss", "peak_loss_ratio",
                  "energy_ratio", "median_pi", "mean_pi", "pi_zero_fraction",
                  "pi_clip_fraction")


def aggregate(setting: Setting, results: list[SimResult]) -> dict[str, Any]:
    """One table row: the mean and range over seeds of what each run ended with."""
    summaries = [r.summary for r in results]

    def spread(name: str) -> dict[str, float]:
        values = np.array([s[name] for s in summaries], dtype=float)
        return {"mean": float(np.mean(values)), "min": float(np.min(values)),
                "max": float(np.max(values))}

    return {**setting.describe(), "seeds": len(results),
            "diverged": sum(bool(s["diverged"]) for s in summaries),
            "stalled": sum(bool(s["stalled"]) for s in summaries),
            **{name: spread(name) for name in SUMMARY_FIELDS}}


def _cell(stats: dict[str, float], digits: int, percent: bool = False) -> str:
    scale = 100 if percent else 1
    mean, low, high = (scale * stats[k] for k in ("mean", "min", "max"))
    if not all(math.isfinite(v) for v in (mean, low, high)):
        return "NaN"
    return f"{mean:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def _mean(stats: dict[str, float], digits: int) -> str:
    return f"{stats['mean']:.{digits}f}" if math.isfinite(stats["mean"]) else "-"


def table(rows: list[dict[str, Any]], plan: Plan) -> str:
    head = ("| figure | rule | n | eta | kappa | updates | final train loss | test accuracy % "
            "| diverged | stalled | peak / start | energy ratio | median pi | mean pi | pi = 0 "
            "| pi = pi_max |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        lines.append(
            f"| {r['figures']} | {r['rule']} | {r['workers']} | {r['lr']:g} | {r['kappa']:g} "
            f"| {r['updates']} | {_cell(r['train_loss'], 4)} "
            f"| {_cell(r['test_accuracy'], 1, percent=True)} | {r['diverged']}/{r['seeds']} "
            f"| {r['stalled']}/{r['seeds']} | {_cell(r['peak_loss_ratio'], 2)} "
            f"| {_cell(r['energy_ratio'], 2)} "
            f"| {_cell(r['median_pi'], 3)} | {_mean(r['mean_pi'], 3)} "
            f"| {_mean(r['pi_zero_fraction'], 2)} | {_mean(r['pi_clip_fraction'], 2)} |")
    note = (f"Mean (min-max) over seeds {', '.join(map(str, plan.seeds))}; model {plan.model} "
            f"on {plan.dataset}, batch 64, mu = 0.9, round-robin staleness (every update n-1 "
            f"stale after the first n). Train loss on a fixed subset of {plan.eval_samples} "
            f"training samples, accuracy on {plan.eval_samples} test samples. Diverged: NaN, "
            "or a final loss above the start. Stalled: a final loss above 90% of the start. "
            "Peak / start: the highest loss on the way over the first. Energy ratio, median "
            "and mean pi: run-long means; pi = 0 and pi = pi_max: the shares of elements whose "
            f"pi is clipped there, sampled every {plan.pi_every} updates.")
    return "\n".join([*lines, "", note, ""])


CURVE_KEYS = ("updates", "worker_steps", "train_loss", "test_accuracy", "median_pi",
              "mean_pi", "energy_ratio")


def curves_record(runs: Runs) -> list[dict[str, Any]]:
    """Every run's curve (5 significant digits), for analyses the figures do not show."""
    return [{**s.describe(), "seeds": [[{k: _round(row[k]) for k in CURVE_KEYS}
                                         for row in r.curve] for r in results]}
            for s, results in runs.items()]


def _round(value: float) -> float:
    return float(f"{value:.5g}")


def write_outputs(out: Path, plan: Plan, runs: Runs, by_figure: dict[str, list[Setting]],
                  extra: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = figures.draw_all(out, runs, by_figure, plan)
    figures_of = {s: [f for f, ss in by_figure.items() if s in ss] for s in runs}
    rows = [{**aggregate(s, results), "figures": ", ".join(figures_of[s])}
            for s, results in runs.items()]
    (out / "table.md").write_text(table(rows, plan))
    results = {"plan": asdict(plan), "settings": rows, **extra}
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=1) + "\n")
    (out / "curves.json").write_text(json.dumps(_jsonable(curves_record(runs))) + "\n")
    return [*written, out / "table.md", out / "results.json", out / "curves.json"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paper", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny budgets, logreg on digits")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started, cpu, load_before = time.perf_counter(), time.process_time(), os.getloadavg()
    data = load_dataset(plan.dataset)
    by_figure = figure_settings(plan)
    unique = list(dict.fromkeys(s for group in by_figure.values() for s in group))
    runs = run_all(plan, data, unique)
    bench = speed(plan, data)
    extra: dict[str, Any] = {
        "wall_time_s": time.perf_counter() - started,  # the experiments, before the drawing
        # CPU time of this one process: what the set costs whatever else the machine runs.
        "cpu_time_s": time.process_time() - cpu,
        "speed": bench,
        # The load average says how much the machine was shared while the numbers were taken.
        "machine": {"cpus": os.cpu_count(), "load_average_before": load_before,
                    "load_average_after": os.getloadavg(), "python": platform.python_version(),
                    "torch": torch.__version__}}
    for path in write_outputs(args.out, plan, runs, by_figure, extra):
        print(path)
    print(f"experiments: {extra['wall_time_s']:.0f}s ({extra['cpu_time_s']:.0f}s of CPU); "
          f"total with figures: {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
