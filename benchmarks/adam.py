"""GEM for Adam users, on a transformer: the figures and numbers of docs/results/adam/.

    python -m benchmarks.adam            # the full set (about an hour on one core)
    python -m benchmarks.adam --quick    # a smoke test of the whole pipeline, seconds
    python -m benchmarks.adam --real     # only the batch split on the real system

The workload is ``small_transformer`` below (a 2-layer decoder-only transformer, 137,216
parameters) on ``pysource`` (gemq/training/text.py: the standard library's own source, in
windows of 64 bytes), with held-out loss in nats per byte as the evaluation. Four rules:

- synchronous Adam, the proxy (``gemq simulate --reference --optimizer adam``);
- asynchronous Adam: Adam applied at the aggregator to each stale gradient as it lands, one
  state for the run (``--algo downpour --optimizer adam``, DOWNPOUR's analogue);
- GEM with the Adam proxy (``--algo gem --optimizer adam``);
- GEM with the paper's momentum-SGD proxy (``--algo gem``, lr 0.05).

The simulator (gemq.sim.engine, the aggregator's own rule objects) runs n workers under the
round-robin staleness model: every update n - 1 updates stale. Each worker contributes the
same number of steps whatever n, so every setting runs for the same simulated wall-clock:
one time unit is one worker step at the sweep's batch, and a step at half the batch is
counted half a unit (compute in proportion to the batch, the assumption of the paper's
figure 4). The batch split compares n workers at batch B with 2n at B / 2: the same samples
per round, half the time per step.

The same split runs on the real system too (``--real``): ``gemq.train`` with its private
Redis, worker processes on this machine's cores, time to the target held-out loss measured
on the wall clock from the run's metrics.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.paper_plan import Variant as Rule  # noqa: E402
from gemq.config import DEFAULT_LR, RunConfig  # noqa: E402
from gemq.sim.engine import simulate  # noqa: E402
from gemq.sim.options import SimOptions  # noqa: E402
from gemq.sim.results import SimResult  # noqa: E402
from gemq.training.text import pysource, unigram_loss  # noqa: E402
from gemq.training.transformer import Transformer  # noqa: E402

DEFAULT_OUT = Path("docs/results/adam")
MODEL_SPEC = "benchmarks.adam:small_transformer"


def small_transformer() -> Transformer:
    """The figures' model: 2 layers of width 64, 4 heads, on 64-byte windows (137,216
    parameters): about 18 ms a step at batch 16 on one core of the 2-core machine, so that
    the 32-worker settings fit in minutes."""
    return Transformer(vocab=256, context=64, d_model=64, layers=2, heads=4)


SYNC_ADAM = Rule("synchronous Adam (proxy)", "downpour", reference=True, optimizer="adam")
ASYNC_ADAM = Rule("asynchronous Adam", "downpour", optimizer="adam")
GEM_ADAM = Rule("GEM, Adam proxy", optimizer="adam")
GEM_MOMENTUM = Rule("GEM, momentum proxy")
RULES = (SYNC_ADAM, ASYNC_ADAM, GEM_ADAM, GEM_MOMENTUM)
COLORS = {SYNC_ADAM: "black", ASYNC_ADAM: "tab:red", GEM_ADAM: "tab:blue",
          GEM_MOMENTUM: "tab:green"}


@dataclass(frozen=True)
class Plan:
    ns: tuple[int, ...] = (4, 16, 32)
    steps_per_worker: int = 150
    seeds: tuple[int, ...] = (0, 1, 2)
    batch: int = 16
    adam_lr: float = 3e-3
    points: int = 10
    eval_samples: int = 256
    #: (n, 2n) pairs of the batch split, at batch B and B / 2.
    split_ns: tuple[int, ...] = (4, 16)
    #: The real system's split: n workers of batch B against 2n of B / 2.
    real_n: int = 2
    real_updates: int = 600
    real_seeds: tuple[int, ...] = (0, 1, 2)


FULL = Plan()
QUICK = Plan(ns=(2, 4), steps_per_worker=6, seeds=(0,), points=3, eval_samples=32,
             split_ns=(2,), real_updates=30, real_seeds=(0,))


@dataclass(frozen=True)
class Setting:
    rule: Rule
    workers: int
    batch: int
    steps_per_worker: int

    @property
    def updates(self) -> int:
        return self.workers * self.steps_per_worker

    def key(self) -> str:
        return f"{self.rule.label} | n={self.workers} | B={self.batch}"


def config_of(plan: Plan, setting: Setting, seed: int) -> RunConfig:
    rule = setting.rule
    lr = plan.adam_lr if rule.optimizer == "adam" else DEFAULT_LR["momentum"]
    return RunConfig(run_id="adam", algo=rule.algo, optimizer=rule.optimizer, lr=lr,
                     momentum=0.9, batch_size=setting.batch, budget_updates=setting.updates,
                     model=MODEL_SPEC, dataset="pysource", seed=seed,
                     max_staleness=max(512, setting.workers))


def sweep_settings(plan: Plan) -> list[Setting]:
    per = plan.steps_per_worker
    settings = [Setting(SYNC_ADAM, 1, plan.batch, per)]
    settings += [Setting(rule, n, plan.batch, per) for n in plan.ns for rule in RULES[1:]]
    return settings


def split_settings(plan: Plan) -> list[Setting]:
    """n workers at B and 2n at B / 2, for GEM-Adam and asynchronous Adam: each worker of
    the 2n makes twice the steps, in the same simulated time."""
    per, half = plan.steps_per_worker, plan.batch // 2
    return [Setting(rule, m, batch, steps) for n in plan.split_ns for rule in (GEM_ADAM, ASYNC_ADAM)
            for m, batch, steps in ((n, plan.batch, per), (2 * n, half, 2 * per))]


Runs = dict[Setting, list[SimResult]]


def run_all(plan: Plan, settings: Iterable[Setting], jobs: int = 1) -> Runs:
    """Every setting once per seed, in ``jobs`` processes of one torch thread each."""
    settings = list(dict.fromkeys(settings))
    tasks = [(plan, setting, seed) for setting in settings for seed in plan.seeds]
    runs: Runs = {setting: [] for setting in settings}
    with (tqdm(total=sum(s.updates for s in settings) * len(plan.seeds), unit="upd",
               dynamic_ncols=True, desc="adam") as bar,
          multiprocessing.get_context("spawn").Pool(jobs) as pool):
        # Longest first, so that the last job to start is a short one.
        tasks.sort(key=lambda task: -task[1].updates * task[1].batch)
        for setting, result in pool.imap_unordered(_simulate_one, tasks):
            runs[setting].append(result)
            bar.update(setting.updates)
    for results in runs.values():
        results.sort(key=lambda r: r.config.seed)
    return runs


def _simulate_one(task: tuple[Plan, Setting, int]) -> tuple[Setting, SimResult]:
    plan, setting, seed = task
    torch.set_num_threads(1)
    options = SimOptions(workers=setting.workers, reference=setting.rule.reference,
                         eval_every=max(1, setting.updates // plan.points),
                         eval_samples=plan.eval_samples)
    return setting, simulate(config_of(plan, setting, seed), options, data=pysource())


def time_units(setting: Setting, plan: Plan, row: dict[str, float]) -> float:
    """Simulated wall-clock: worker steps, a step at batch b counting b / B."""
    return row["time"] * setting.batch / plan.batch


def curve(runs: Runs, setting: Setting, plan: Plan, x: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, held-out loss: seeds x points) of one setting; NaN past a run that stopped."""
    results = runs[setting]
    longest = max(results, key=lambda r: len(r.curve)).curve
    xs = np.array([row["updates"] if x == "updates" else time_units(setting, plan, row)
                   for row in longest], dtype=float)
    losses = np.full((len(results), len(xs)), np.nan)
    for i, result in enumerate(results):
        values = [row["test_loss"] for row in result.curve]
        losses[i, :len(values)] = values
    return xs, losses


def first_below(xs: np.ndarray, losses: np.ndarray, target: float) -> float:
    """Mean over seeds of the first x where the held-out loss is at or below ``target``
    (NaN if a seed never gets there)."""
    hits = []
    for row in losses:
        below = np.flatnonzero(row <= target)
        hits.append(xs[below[0]] if below.size else math.nan)
    return float(np.mean(hits))


def summarise(runs: Runs, plan: Plan, target: float) -> list[dict[str, Any]]:
    rows = []
    for setting, results in runs.items():
        finals = [r.summary["test_loss"] for r in results]
        xs_u, losses = curve(runs, setting, plan, "updates")
        xs_t, _ = curve(runs, setting, plan, "time")
        rows.append({
            "rule": setting.rule.label, "workers": setting.workers, "batch": setting.batch,
            "updates": setting.updates, "final_test_loss": float(np.mean(finals)),
            "final_test_loss_min": float(np.min(finals)),
            "final_test_loss_max": float(np.max(finals)),
            "diverged": sum(bool(r.summary["diverged"]) for r in results),
            "energy_ratio": float(np.mean([r.summary["energy_ratio"] for r in results])),
            "median_pi": float(np.mean([r.summary["median_pi"] for r in results])),
            "updates_to_target": first_below(xs_u, losses, target),
            "time_to_target": first_below(xs_t, losses, target)})
    return rows


def table_markdown(rows: list[dict[str, Any]], unigram: float, target: float) -> str:
    """The summary as a markdown table: mean over seeds (min-max)."""
    lines = [f"Unigram baseline {unigram:.3f} nats/byte; target held-out loss {target:.3f}.",
             "",
             "| rule | n | batch | updates | final held-out loss (min-max) | diverged | "
             "energy ratio | median pi | updates to target | time to target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['workers']} | {r['batch']} | {r['updates']:,} | "
            f"{r['final_test_loss']:.3f} ({r['final_test_loss_min']:.3f}-"
            f"{r['final_test_loss_max']:.3f}) | {r['diverged']} | {r['energy_ratio']:.2f} | "
            f"{r['median_pi']:.3f} | {_number(r['updates_to_target'])} | "
            f"{_number(r['time_to_target'])} |")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return "not every seed" if not math.isfinite(value) else f"{value:,.0f}"


def _band(ax: Any, xs: np.ndarray, losses: np.ndarray, label: str, color: str,
          style: str = "-") -> None:
    with warnings.catch_warnings():  # all-NaN columns: past a diverged seed's end
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(losses, axis=0)
        ax.fill_between(xs, np.nanmin(losses, axis=0), np.nanmax(losses, axis=0),
                        color=color, alpha=0.15, linewidth=0)
    ax.plot(xs, mean, style, color=color, label=label)


def _axes(ax: Any, title: str, xlabel: str, unigram: float) -> None:
    ax.axhline(unigram, color="grey", linestyle=":", linewidth=1, label="unigram baseline")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.grid(alpha=0.3)


def draw_sweep(path: Path, runs: Runs, plan: Plan, unigram: float, x: str) -> Path:
    fig, axes = plt.subplots(1, len(plan.ns), figsize=(5 * len(plan.ns), 4), sharey=True)
    sync = Setting(SYNC_ADAM, 1, plan.batch, plan.steps_per_worker)
    for ax, n in zip(np.atleast_1d(axes), plan.ns, strict=True):
        for rule in RULES[1:]:
            setting = Setting(rule, n, plan.batch, plan.steps_per_worker)
            _band(ax, *curve(runs, setting, plan, x), rule.label, COLORS[rule])
        _band(ax, *curve(runs, sync, plan, x), SYNC_ADAM.label, "black", "--")
        _axes(ax, f"n = {n} workers, batch {plan.batch}",
              "central updates" if x == "updates" else "simulated time (worker steps)",
              unigram)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    top = 1.15 * max(unigram, 0.1)
    for ax in np.atleast_1d(axes):
        ax.set_ylim(top=top)
    return _save(fig, path)


def draw_split(path: Path, runs: Runs, plan: Plan, unigram: float) -> Path:
    fig, axes = plt.subplots(1, len(plan.split_ns), figsize=(6 * len(plan.split_ns), 4),
                             sharey=True)
    half = plan.batch // 2
    for ax, n in zip(np.atleast_1d(axes), plan.split_ns, strict=True):
        for rule in (GEM_ADAM, ASYNC_ADAM):
            for m, batch, steps, style in ((n, plan.batch, plan.steps_per_worker, "-"),
                                           (2 * n, half, 2 * plan.steps_per_worker, "--")):
                setting = Setting(rule, m, batch, steps)
                _band(ax, *curve(runs, setting, plan, "time"),
                      f"{rule.label}, {m} x B={batch}", COLORS[rule], style)
        _axes(ax, f"batch split: {n} x {plan.batch} against {2 * n} x {half}",
              "simulated time (steps at batch B)", unigram)
        ax.set_ylim(top=1.15 * max(unigram, 0.1))
    np.atleast_1d(axes)[0].legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the real system --------------------------------------------------------------------


def real_split(plan: Plan, target: float, out: Path) -> list[dict[str, Any]]:
    """n workers at B against 2n at B / 2 through ``gemq.train`` (a private Redis, one
    process per worker), GEM-Adam and asynchronous Adam, the same updates budget."""
    import gemq

    rows = []
    n, batch = plan.real_n, plan.batch
    for rule in (GEM_ADAM, ASYNC_ADAM):
        for workers, b in ((n, batch), (2 * n, batch // 2)):
            for seed in plan.real_seeds:
                with tempfile.TemporaryDirectory() as folder:
                    started = time.monotonic()
                    summary = gemq.train(
                        MODEL_SPEC, "pysource", algo=rule.algo, optimizer="adam",
                        lr=plan.adam_lr, workers=workers, batch_size=b,
                        steps=plan.real_updates, seed=seed,
                        eval_every=max(1, plan.real_updates // plan.points),
                        out_dir=folder, progress=False)
                    wall = time.monotonic() - started
                    heldout = _heldout_curve(summary.metrics_path)
                rows.append({"rule": rule.label, "workers": workers, "batch": b,
                             "seed": seed, "updates": summary.updates_applied,
                             "wall_s": wall, "final_test_loss": summary.test_loss,
                             "updates_per_s": summary.updates_per_s,
                             "updates_to_target": _first(heldout, target, "updates"),
                             "seconds_to_target": _first(heldout, target, "seconds")})
                print(json.dumps(rows[-1]), flush=True)
    (out / "real_split.json").write_text(json.dumps(_finite(rows), indent=1) + "\n")
    return rows


def _heldout_curve(metrics: Path) -> list[dict[str, float]]:
    """(updates, seconds since the first row, held-out loss) of a run's evaluations."""
    with metrics.open(newline="") as f:
        rows = list(csv.DictReader(f))
    start = float(rows[0]["t_ms"])
    return [{"updates": float(r["eval_updates"]), "seconds": (float(r["t_ms"]) - start) / 1000,
             "loss": float(r["test_loss"])} for r in rows if r.get("test_loss")]


def _first(curve: list[dict[str, float]], target: float, field: str) -> float | None:
    return next((row[field] for row in curve if row["loss"] <= target), None)


# --- main ---------------------------------------------------------------------------------


def target_loss(unigram: float, sync_final: float) -> float:
    """The loss a split must reach: two thirds of the way from the unigram baseline down to
    synchronous Adam's final loss, a level every rule that learns passes through."""
    return unigram - 2 / 3 * (unigram - sync_final)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test, seconds")
    parser.add_argument("--real", action="store_true",
                        help="only the real system's batch split (needs results.json)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=1,
                        help="simulations at once, one core each (default 1)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    data = pysource()
    unigram = unigram_loss(data)
    if args.real:
        saved = json.loads((args.out / "results.json").read_text())
        real_split(plan, saved["target_loss"], args.out)
        return 0
    started = time.monotonic()
    runs = run_all(plan, [*sweep_settings(plan), *split_settings(plan)], args.jobs)
    sync = runs[Setting(SYNC_ADAM, 1, plan.batch, plan.steps_per_worker)]
    target = target_loss(unigram, float(np.mean([r.summary["test_loss"] for r in sync])))
    table = summarise(runs, plan, target)
    figures = [draw_sweep(args.out / "loss_vs_updates.png", runs, plan, unigram, "updates"),
               draw_sweep(args.out / "loss_vs_time.png", runs, plan, unigram, "time"),
               draw_split(args.out / "batch_split.png", runs, plan, unigram)]
    result = {"plan": asdict(plan), "unigram_loss": unigram, "target_loss": target,
              "model": MODEL_SPEC, "parameters": sum(p.numel() for p in
                                                      small_transformer().parameters()),
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpus": os.cpu_count()},
              "wall_s": time.monotonic() - started, "table": table,
              "curves": {s.key(): [[row | {"time_units": time_units(s, plan, row)}
                                    for row in r.curve] for r in rs]
                         for s, rs in runs.items()}}
    (args.out / "results.json").write_text(json.dumps(_finite(result), indent=1) + "\n")
    (args.out / "table.md").write_text(table_markdown(table, unigram, target))
    for row in table:
        print(json.dumps(_finite(row)))
    print("wrote", *figures, args.out / "results.json")
    return 0


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as None: JSON has neither."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


if __name__ == "__main__":
    raise SystemExit(main())
