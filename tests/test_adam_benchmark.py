"""benchmarks/adam.py: the whole pipeline in --quick mode, and its arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.adam import (
    ASYNC_ADAM,
    GEM_ADAM,
    QUICK,
    RULES,
    Setting,
    first_below,
    small_transformer,
    split_settings,
    sweep_settings,
    target_loss,
    time_units,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_writes_the_figures_the_table_and_every_setting(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.adam", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("loss_vs_updates", "loss_vs_time", "batch_split"):
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
    results = json.loads((tmp_path / "results.json").read_text())
    settings = dict.fromkeys([*sweep_settings(QUICK), *split_settings(QUICK)])
    assert len(results["table"]) == len(settings) == len(results["curves"])
    assert {row["rule"] for row in results["table"]} == {rule.label for rule in RULES}
    assert 0 < results["unigram_loss"] < math.log(256)
    sync, = (row for row in results["table"] if row["rule"] == RULES[0].label)
    assert results["target_loss"] == pytest.approx(
        target_loss(results["unigram_loss"], sync["final_test_loss"]))
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| ") == len(settings) + 1  # the header, then one row each


def test_the_split_pairs_n_at_b_with_2n_at_half_b_for_the_same_time() -> None:
    pairs = split_settings(QUICK)
    assert [(s.rule, s.workers, s.batch) for s in pairs[:2]] == [
        (GEM_ADAM, 2, 16), (GEM_ADAM, 4, 8)]
    assert {s.rule for s in pairs} == {GEM_ADAM, ASYNC_ADAM}
    n_at_b, two_n_at_half = pairs[0], pairs[1]
    # Same samples per round; each worker of the 2n makes twice the steps at half the cost.
    assert n_at_b.workers * n_at_b.batch == two_n_at_half.workers * two_n_at_half.batch
    row = {"time": 2.0 * n_at_b.steps_per_worker}
    assert time_units(two_n_at_half, QUICK, row) == time_units(n_at_b, QUICK, {
        "time": n_at_b.steps_per_worker})


def test_first_below_and_the_target() -> None:
    xs = np.array([0.0, 10.0, 20.0])
    losses = np.array([[5.0, 3.0, 2.0], [5.0, 4.0, 3.0]])
    assert first_below(xs, losses, 3.0) == 15.0  # 10 and 20: the mean over seeds
    assert math.isnan(first_below(xs, losses, 2.5))  # one seed never gets there
    assert target_loss(3.0, 2.1) == pytest.approx(2.4)


def test_the_figures_model_is_the_size_its_docstring_gives() -> None:
    assert sum(p.numel() for p in small_transformer().parameters()) == 137_216
    assert Setting(GEM_ADAM, 4, 16, 10).updates == 40
