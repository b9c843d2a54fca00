"""The figures of benchmarks/paper.py: mean over seeds as a line, min-max as a band."""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from benchmarks.paper_plan import (  # noqa: E402
    ADAPTIVE,
    DCASGD,
    DOWNPOUR,
    GEM,
    GLOBAL,
    PROXY,
    Plan,
    Setting,
    Variant,
)
from gemq.sim.results import SimResult  # noqa: E402

Runs = dict[Setting, list[SimResult]]
COLORS = {GEM: "tab:blue", DOWNPOUR: "tab:red", ADAPTIVE: "tab:green", GLOBAL: "tab:purple",
          DCASGD: "tab:orange", PROXY: "black"}
STYLES = {PROXY: "--", GLOBAL: "-.", DCASGD: ":"}


def stacked(results: list[SimResult], field: str) -> tuple[np.ndarray, np.ndarray]:
    """(x = central updates, values: seeds x points), NaN past a run that stopped early."""
    longest = max(results, key=lambda r: len(r.curve)).curve
    x = np.array([row["updates"] for row in longest], dtype=float)
    values = np.full((len(results), len(x)), np.nan)
    for i, result in enumerate(results):
        values[i, :len(result.curve)] = [row[field] for row in result.curve]
    return x, values


Color = str | tuple[float, float, float, float]


def band(ax: Axes, results: list[SimResult], field: str, label: str, color: Color,
         style: str = "-") -> None:
    x, values = stacked(results, field)
    with warnings.catch_warnings():  # an all-NaN column (every seed diverged) stays empty
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = values.mean(axis=0)  # NaN once any seed diverged: the line stops there
        low, high = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
    ax.plot(x, mean, style, color=color, label=label, linewidth=1.4)
    ax.fill_between(x, low, high, color=color, alpha=0.18, linewidth=0)


def _loss_axes(ax: Axes, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("central updates")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curve(ax: Axes, runs: Runs, setting: Setting, field: str = "train_loss",
           label: str | None = None, upto: int | None = None) -> None:
    results = runs[setting]
    if upto is not None:  # the shared proxy run is longer than some panels
        results = [_truncated(r, upto) for r in results]
    v = setting.variant
    band(ax, results, field, label or v.label, COLORS[v], STYLES.get(v, "-"))


def _truncated(result: SimResult, upto: int) -> SimResult:
    curve = [row for row in result.curve if row["updates"] <= upto]
    return SimResult(result.config, result.options, curve, result.tensors, [], result.summary,
                     result.theta)


def _by(settings: list[Setting], variant: Variant) -> list[Setting]:
    return [s for s in settings if s.variant == variant]


def panels_by_n(path: Path, runs: Runs, settings: list[Setting], variants: tuple[Variant, ...],
                title: str) -> Path:
    """One panel per worker count; one curve per rule; the proxy for reference."""
    ns = sorted({s.workers for s in settings if not s.variant.reference})
    proxy = _by(settings, PROXY)
    fig, axes = plt.subplots(1, len(ns), figsize=(3.6 * len(ns), 3.4), sharey=True)
    for ax, n in zip(np.atleast_1d(axes), ns, strict=True):
        panel = [s for s in settings if s.workers == n and s.variant in variants]
        for setting in panel:
            _curve(ax, runs, setting)
        if proxy:
            _curve(ax, runs, proxy[0], upto=panel[0].updates)
        _loss_axes(ax, f"n = {n}")
    np.atleast_1d(axes)[0].set_ylabel("training loss")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def final_vs_n(path: Path, runs: Runs, settings: list[Setting]) -> Path:
    """Figure 1's summary: final training loss against n, one line per rule."""
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for variant in (GEM, DOWNPOUR, ADAPTIVE, GLOBAL, DCASGD):
        points = sorted(_by(settings, variant), key=lambda s: s.workers)
        if not points:
            continue
        finals = np.array([[r.summary["train_loss"] for r in runs[s]] for s in points])
        x = [s.workers for s in points]
        ax.errorbar(x, finals.mean(axis=1), capsize=3, color=COLORS[variant],
                    yerr=[finals.mean(axis=1) - finals.min(axis=1),
                          finals.max(axis=1) - finals.mean(axis=1)],
                    fmt="o" + STYLES.get(variant, "-"), label=variant.label)
    ax.set_xlabel("workers n")
    ax.set_ylabel("final training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title("Final training loss after one epoch per worker", fontsize=10)
    return _save(fig, path)


def large_n(path: Path, runs: Runs, settings: list[Setting]) -> Path:
    """Figure 2: GEM at the largest n, beside GEM at the largest sweep n and the proxy."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    gems = sorted(_by(settings, GEM), key=lambda s: -s.workers)
    for ax, field in ((left, "train_loss"), (right, "test_accuracy")):
        for setting, color in zip(gems, ("tab:blue", "tab:cyan"), strict=False):
            band(ax, runs[setting], field, f"GEM n = {setting.workers}", color)
        _curve(ax, runs, _by(settings, PROXY)[0], field)
        ax.set_xlabel("central updates")
        ax.grid(alpha=0.3)
    _loss_axes(left, "training loss")
    right.set_title("test accuracy", fontsize=10)
    right.legend(fontsize=7)
    return _save(fig, path)


def median_pi(path: Path, runs: Runs, settings: list[Setting]) -> Path:
    """Figure 3: median pi (the paper's statistic) and mean pi over time, for each n."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    cmap = plt.get_cmap("viridis")
    points = sorted(settings, key=lambda s: s.workers)
    for ax, field in zip(axes, ("median_pi", "mean_pi"), strict=True):
        for i, setting in enumerate(points):
            color = cmap(i / max(1, len(points) - 1))
            band(ax, runs[setting], field, f"n = {setting.workers}", color)
            ax.axhline(1 / setting.workers, color=color, linestyle=":", linewidth=0.8)
        ax.set_yscale("symlog", linthresh=1e-3)  # median pi is often exactly 0
        ax.set_ylim(bottom=0)
        ax.set_xlabel("central updates")
        ax.set_ylabel(f"{field.replace('_', ' ')} (window mean)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_title("GEM: median pi over time (dotted: 1/n)", fontsize=10)
    axes[1].set_title("GEM: mean pi over time (dotted: 1/n)", fontsize=10)
    axes[1].legend(fontsize=7)
    return _save(fig, path)


def curves(path: Path, runs: Runs, settings: list[Setting], title: str,
           label_of: dict[Setting, str] | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    cmap = plt.get_cmap("plasma")
    for i, setting in enumerate(settings):
        label = (label_of or {}).get(setting)
        if label is None:
            _curve(ax, runs, setting)
        else:
            band(ax, runs[setting], "train_loss", label, cmap(i / max(1, len(settings))))
    _loss_axes(ax, title)
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    return _save(fig, path)


def heatmap(path: Path, runs: Runs, setting: Setting) -> Path:
    """Figures 9-10 on the CNN: median and mean pi of each tensor over time, seed mean."""
    results = runs[setting]
    rows = min(len(r.pi_tensors) for r in results)
    updates = [row["updates"] for row in results[0].pi_tensors[:rows]]
    names = results[0].tensors
    fig, axes = plt.subplots(2, 1, figsize=(9, 0.7 * len(names) + 2.4), sharex=True)
    for ax, stat in zip(axes, ("median", "mean"), strict=True):
        grid = np.mean([[row[stat] for row in r.pi_tensors[:rows]] for r in results],
                       axis=0).T  # tensors x time
        image = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest",
                          extent=(updates[0], updates[-1], len(names) - 0.5, -0.5))
        ax.set_yticks(range(len(names)), names, fontsize=7)
        fig.colorbar(image, ax=ax, label=f"{stat} pi")
        ax.set_title(f"GEM, n = {setting.workers}: {stat} pi of each tensor "
                     f"(one update every {updates[1] - updates[0] if rows > 1 else 1})",
                     fontsize=10)
    axes[-1].set_xlabel("central updates")
    return _save(fig, path)


def draw_all(out: Path, runs: Runs, by_figure: dict[str, list[Setting]],
             plan: Plan) -> list[Path]:
    paper = (GEM, DOWNPOUR, ADAPTIVE)
    kappa = {s: f"kappa = {s.kappa:g}" for s in by_figure["fig8"]}
    return [
        panels_by_n(out / "fig1_curves.png", runs, by_figure["fig1"], paper,
                    "GEM, DOWNPOUR and adaptive staleness (eta = 0.05); dashed: the proxy"),
        final_vs_n(out / "fig1_final_loss_vs_n.png", runs, by_figure["beyond"]),
        panels_by_n(out / "beyond_curves.png", runs, by_figure["beyond"],
                    (GEM, GLOBAL, DCASGD, DOWNPOUR),
                    "Beyond the paper: global proxy and DC-ASGD (eta = 0.05)"),
        large_n(out / "fig2_large_n.png", runs, by_figure["fig2"]),
        median_pi(out / "fig3_median_pi.png", runs, by_figure["fig3"]),
        curves(out / "fig6_lr0.1.png", runs, by_figure["fig6"],
               f"eta = 0.1, n = {plan.n_lr}"),
        curves(out / "fig8_kappa.png", runs, by_figure["fig8"],
               f"GEM, kappa = 1..4, n = {plan.n_kappa}", kappa),
        heatmap(out / "fig9_pi_heatmap.png", runs, by_figure["heatmap"][0]),
    ]
