"""Smoke test of the performance suite: every benchmark runs on a tiny budget (--quick)
and writes well-formed JSON. No figure is judged here: benchmarks are never timed tests."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Headline sections and the keys --quick must fill in each.
EXPECTED = {
    "transport_ratio": ["cnn"],
    "transport_ratio_fp16": ["cnn"],
    "transport_ratio_bf16": ["cnn"],
    "wire_fp16_speedup": ["cnn"],
    "wire_bf16_speedup": ["cnn"],
    "compute_ratio": ["n2"],
    "publication_policy": ["n2"],
    "compute_ratio_bf16": ["n2"],
    "speedup_over_sgd": ["n2"],
    "speedup_over_reference": ["n2"],
    "update_rate_over_reference": ["n2"],
    "wire_fp16": ["n2"],
    "wire_bf16": ["n2"],
    "scale": ["redis_memory_late_over_early", "redis_memory_over_design_bound",
              "total_rss_over_8gb", "aggregator_growth_per_worker_over_moment"],
    "telemetry_overhead": ["worker_silent", "worker_prometheus", "smallest_model_worker_prometheus",
                           "aggregator_prometheus"],
    "shards_speedup": ["two_redis", "one_redis", "two_redis_release_pages", "keep_pages"],
    "shards_core_bound_speedup": ["two_redis", "one_redis"],
    "shards_cpu_speedup": ["two_redis", "one_redis"],
    "shard_bytes_rate": ["0.16m"],
    "big_model_ratio": ["s1"],
}


def _numbers(tree: object) -> list[object]:
    if isinstance(tree, dict):
        return [n for value in tree.values() for n in _numbers(value)]
    return [tree]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_suite_writes_well_formed_ratios(tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.perf", "--quick", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert result["machine"]["cpu_count"] >= 1
    assert len(result["machine"]["load_average_at_start"]) == 3
    for section, keys in EXPECTED.items():
        assert set(keys) <= set(result[section]), (section, result[section])
        for key in keys:
            values = _numbers(result[section][key])
            assert all(isinstance(v, int | float) and math.isfinite(v) for v in values), (
                section, key, values)
    # Accuracy differences may be negative, staleness zero; every ratio must be positive.
    signed = ("wire_fp16", "wire_bf16", "publication_policy")
    ratios = _numbers({k: result[k] for k in EXPECTED if k not in signed})
    ratios += [p["compute_ratio"] for p in result["publication_policy"]["n2"].values()]
    assert all(v > 0 for v in ratios), ratios  # type: ignore[operator]
    assert {"every_batch", "every_25ms"} <= set(result["publication_policy"]["n2"])
    assert "ratio" in proc.stdout and "transport_ratio.cnn" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_split_tool_accounts_every_process() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.perf.cpu", "--workers", "2",
                           "--seconds", "1", "--set", "publish_interval_ms=10"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("2 workers: ") and "steps/s" in lines[0]
    labels = [line.split()[0] for line in lines[1:]]
    assert labels == ["redis", "aggregator", "worker_process_0", "worker_process_1", "total"]
    assert all(float(line.split()[1]) > 0 for line in lines[1:])
