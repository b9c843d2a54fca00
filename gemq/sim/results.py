"""What a simulation returns, and how it is written: JSON (everything) or CSV (the curve)."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gemq.config import RunConfig
from gemq.errors import ConfigError
from gemq.sim.options import SimOptions

#: One row of the recorded curves: these keys, in this order (the CSV header).
CURVE_FIELDS = ("updates", "gradients", "worker_steps", "epochs", "time", "train_loss",
                "test_loss", "test_accuracy", "batch_loss", "batch_accuracy", "median_pi",
                "mean_pi", "energy_ratio", "staleness_mean", "staleness_min", "staleness_max",
                "rejected")


@dataclass
class SimResult:
    config: RunConfig
    options: SimOptions
    curve: list[dict[str, float]]
    tensors: list[str]
    #: Every ``pi_every`` updates: the median and mean pi of each tensor, and the shares of
    #: elements whose pi is 0 and at pi_max (for the per-tensor heat map).
    pi_tensors: list[dict[str, Any]]
    summary: dict[str, Any]
    theta: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return _finite_or_none({
            "config": asdict(self.config), "simulation": self.options.as_dict(),
            "summary": self.summary, "curve": self.curve, "tensors": self.tensors,
            "pi_tensors": self.pi_tensors})


def _finite_or_none(value: Any) -> Any:
    """NaN and infinities become null: strict JSON has no spelling for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def check_output_path(path: Path) -> None:
    if path.suffix.lower() not in (".json", ".csv"):
        raise ConfigError("--out", f"must end in .json or .csv, got {str(path)!r}")


def write_result(result: SimResult, path: Path) -> Path:
    """The whole result as JSON, or the curve alone as CSV (chosen by the suffix)."""
    check_output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        return path
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CURVE_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(result.curve)
    return path


