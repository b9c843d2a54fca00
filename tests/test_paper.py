"""benchmarks/paper.py: the whole pipeline in --quick mode, and the table's formatting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.paper import QUICK, _cell, figure_settings
from benchmarks.paper_plan import ALL

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("fig1_curves", "fig1_final_loss_vs_n", "beyond_curves", "fig2_large_n",
           "fig3_median_pi", "fig6_lr0.1", "fig8_kappa", "fig9_pi_heatmap")


@pytest.mark.slow
def test_quick_run_writes_every_figure_and_the_table(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.paper", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in FIGURES:
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {variant.label} |" in table for variant in ALL)
    results = json.loads((tmp_path / "results.json").read_text())
    unique = {s for group in figure_settings(QUICK).values() for s in group}
    assert len(results["settings"]) == len(unique)
    assert all(row["seeds"] == len(QUICK.seeds) for row in results["settings"])
    speed = results["speed"]
    assert speed["plain_loop_steps_per_s"] > 0
    assert [row["workers"] for row in speed["simulator"]] == list(QUICK.bench_workers)
    assert results["wall_time_s"] > 0


def test_figures_share_runs_between_them() -> None:
    by_figure = figure_settings(QUICK)
    total = sum(len(group) for group in by_figure.values())
    unique = {s for group in by_figure.values() for s in group}
    assert len(unique) < total  # e.g. figure 3 reuses figure 1's GEM runs


def test_table_cells() -> None:
    assert _cell({"mean": 0.25, "min": 0.125, "max": 0.5}, 3) == "0.250 (0.125-0.500)"
    assert _cell({"mean": 0.5, "min": 0.25, "max": 0.75}, 1, percent=True) == \
        "50.0 (25.0-75.0)"
    assert _cell({"mean": float("nan"), "min": 0.1, "max": float("nan")}, 3) == "NaN"
