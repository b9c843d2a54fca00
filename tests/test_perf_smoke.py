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
#: Per benchmark (``python -m benchmarks.perf --only NAME``): the headline sections and the
#: keys --quick must fill in each.
EXPECTED: dict[str, dict[str, list[str]]] = {
    "transport": {"transport_ratio": ["cnn"], "transport_ratio_fp16": ["cnn"],
                  "transport_ratio_bf16": ["cnn"], "wire_fp16_speedup": ["cnn"],
                  "wire_bf16_speedup": ["cnn"]},
    "compute": {"compute_ratio": ["n2"], "publication_policy": ["n2"],
                "compute_ratio_bf16": ["n2"]},
    "time_to_target": {"speedup_over_sgd": ["n2"], "speedup_over_reference": ["n2"],
                       "update_rate_over_reference": ["n2"], "wire_fp16": ["n2"],
                       "wire_bf16": ["n2"]},
    "scale": {"scale": ["redis_memory_late_over_early", "redis_memory_over_design_bound",
                        "total_rss_over_8gb", "aggregator_growth_per_worker_over_moment"]},
    "real_models": {},  # its sections (amp, checkpoint) are reported, not checked here
    "telemetry": {"telemetry_overhead": ["worker_silent", "worker_prometheus",
                                         "smallest_model_worker_prometheus",
                                         "aggregator_prometheus"]},
    "shards": {"shards_speedup": ["two_redis", "one_redis", "two_redis_release_pages",
                                  "keep_pages"],
               "shards_core_bound_speedup": ["two_redis", "one_redis"],
               "shards_cpu_speedup": ["two_redis", "one_redis"]},
    "shard_sizes": {"shard_bytes_rate": ["0.16m"]},
    "big_model": {"big_model_ratio": ["auto"]},
    "versus_ddp": {"ddp_over_gemq": ["uniform_n2"], "reference_over_gemq": ["uniform_n2"],
                   "versus_ddp_accuracy": ["uniform_n2"]},
}
#: Sections whose numbers may be negative or zero (accuracy differences, staleness).
SIGNED = ("wire_fp16", "wire_bf16", "publication_policy")
#: Seconds each ``--quick --only NAME`` subprocess may take: at least 8x its duration as a
#: test on an idle 2-core machine (load average 0.01-0.17 when the tests started):
#: transport 19 s, compute 27 s, time_to_target 19 s, scale 10 s, real_models 16 s,
#: telemetry 4 s, shards 28 s, shard_sizes 6 s, big_model 14 s; versus_ddp 23 s (load
#: average 0.64, three contenders' start-ups). The measuring windows stay
#: 1-2 s: a window of 0.5 s saw no step at all once, at load 4 (a ratio of 0).
TIMEOUT_S = {"transport": 160, "compute": 220, "time_to_target": 180, "scale": 90,
             "real_models": 130, "telemetry": 60, "shards": 230, "shard_sizes": 60,
             "big_model": 120, "versus_ddp": 200}


def _numbers(tree: object) -> list[object]:
    if isinstance(tree, dict):
        return [n for value in tree.values() for n in _numbers(value)]
    return [tree]


def test_every_benchmark_is_smoke_tested() -> None:
    from benchmarks.perf.__main__ import BENCHMARKS, HEADLINES

    assert set(EXPECTED) == set(BENCHMARKS) == set(TIMEOUT_S)
    for name, sections in EXPECTED.items():
        assert set(sections) <= set(HEADLINES[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.timeout(timeout + 20), id=name)
    for name, timeout in TIMEOUT_S.items()])
def test_quick_benchmark_writes_well_formed_ratios(name: str, tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.perf", "--quick", "--only", name,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S[name])
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert result["machine"]["cpu_count"] >= 1
    assert len(result["machine"]["load_average_at_start"]) == 3
    assert "error" not in result["details"][name], result["details"][name]
    expected = EXPECTED[name]
    for section, keys in expected.items():
        assert set(keys) <= set(result[section]), (section, result[section])
        for key in keys:
            values = _numbers(result[section][key])
            assert all(isinstance(v, int | float) and math.isfinite(v) for v in values), (
                section, key, values)
    # Accuracy differences may be negative, staleness zero; every ratio must be positive.
    ratios = _numbers({k: result[k] for k in expected if k not in SIGNED})
    if name == "compute":
        policies = result["publication_policy"]["n2"]
        assert {"every_batch", "every_25ms"} <= set(policies)
        ratios += [p["compute_ratio"] for p in policies.values()]
    assert all(v > 0 for v in ratios), ratios  # type: ignore[operator]
    assert "ratio" in proc.stdout
    if name == "transport":
        assert "transport_ratio.cnn" in proc.stdout


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
