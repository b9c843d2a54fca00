"""python -m benchmarks.perf [--quick] [--only NAME] [--json PATH]

Runs the benchmarks in order, prints one table of ratios (each measured inside this run)
with the target each is held to, and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.perf import (
    big_model,
    compute,
    models,
    scale,
    shard_sizes,
    shards,
    targets,
    telemetry,
    transport,
    versus_ddp,
)
from benchmarks.perf.common import Budget, machine

BENCHMARKS: dict[str, ModuleType] = {m.NAME: m for m in (transport, compute, targets, scale,
                                                           models, telemetry, shards,
                                                           shard_sizes, big_model,
                                                           versus_ddp)}
#: The sections of each benchmark's result that are ratios, lifted to the top of the JSON.
HEADLINES = {
    "transport": ("transport_ratio", "transport_ratio_spread", "transport_ratio_fp16",
                  "transport_ratio_bf16", "wire_fp16_speedup", "wire_bf16_speedup"),
    "compute": ("compute_ratio", "publication_policy", "compute_ratio_bf16"),
    "time_to_target": ("speedup_over_sgd", "speedup_over_reference",
                       "update_rate_over_reference", "wire_fp16", "wire_bf16"),
    "scale": ("scale",),
    "real_models": ("amp", "checkpoint"),
    "telemetry": ("telemetry_overhead",),
    "shards": ("shards_speedup", "shards_speedup_spread", "shards_core_bound_speedup",
               "shards_cpu_speedup"),
    "shard_sizes": ("shard_bytes_rate",),
    "big_model": ("big_model_ratio",),
    "versus_ddp": ("ddp_over_gemq", "reference_over_gemq", "versus_ddp_why",
                   "versus_ddp_accuracy", "versus_ddp_time_to_target_s"),
}
Check = Callable[[float], bool]
#: key prefix -> (target as text, check). Keys with no entry are reported, not judged.
TARGETS: dict[str, tuple[str, Check]] = {
    "transport_ratio.": (">= 0.8", lambda v: v >= 0.8),
    "compute_ratio.n1": ("(none at n=1)", lambda v: True),
    "compute_ratio.": (">= 0.7", lambda v: v >= 0.7),
    "scale.redis_memory_late_over_early": ("<= 1.1 (bounded)", lambda v: v <= 1.1),
    "scale.redis_memory_over_design_bound": ("<= 1", lambda v: v <= 1.0),
    "scale.total_rss_over_8gb": ("< 1", lambda v: v < 1.0),
    "speedup_over_reference.": ("> 1", lambda v: v > 1.0),
    "telemetry_overhead.worker_": ("<= 0.01 (1%)", lambda v: v <= 0.01),
    "shards_speedup.two_redis": (">= 1.6", lambda v: v >= 1.6),
    # No flag at all: what gemq chooses for the model (issue #27; aim 1.0).
    "big_model_ratio.auto": (">= 0.8", lambda v: v >= 0.8),
    "big_model_ratio.": (">= 0.6", lambda v: v >= 0.6),
    # DDP's time to the target over gemq's (issue #29): gemq within 0.8x of DDP with
    # uniform workers, 1.5x faster with a straggler, sooner where DDP must restart.
    "ddp_over_gemq.uniform_": (">= 0.8", lambda v: v >= 0.8),
    "ddp_over_gemq.straggler_": (">= 1.5", lambda v: v >= 1.5),
    "ddp_over_gemq.killed_": ("> 1", lambda v: v > 1.0),
}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def verdict(key: str, value: Any) -> tuple[str, str]:
    for prefix, (text, check) in TARGETS.items():
        if key.startswith(prefix):
            if not isinstance(value, int | float) or not math.isfinite(value):
                return text, "n/a"
            return text, "met" if check(value) else "MISSED"
    return "", ""


def table(headline: dict[str, Any]) -> str:
    rows = [("ratio", "value", "target", "")]
    for key, value in flatten(headline).items():
        rows.append((key, _cell(value), *verdict(key, value)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(_cell(v) for v in value)
    return "-" if value is None else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny budget: a smoke test")
    parser.add_argument("--only", choices=tuple(BENCHMARKS), action="append",
                        help="run only this benchmark (repeatable)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    budget = Budget(args.quick)
    result: dict[str, Any] = {"machine": machine(), "quick": args.quick,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    details: dict[str, Any] = {}
    failed = False
    t0 = time.monotonic()
    for name in args.only or list(BENCHMARKS):
        started = time.monotonic()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        print(f"== {name} ...", file=sys.stderr, flush=True)
        try:
            details[name] = BENCHMARKS[name].run(budget)
        except Exception as e:  # one broken benchmark must not hide the others' numbers
            traceback.print_exc()
            details[name] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
        details[name]["seconds"] = round(time.monotonic() - started, 1)
        details[name]["started"] = stamp
        for section in HEADLINES[name]:
            if section in details[name]:
                result[section] = details[name][section]
    result["duration_s"] = round(time.monotonic() - t0, 1)
    result["details"] = details
    headline = {k: v for k, v in result.items() if k in sum(HEADLINES.values(), ())}
    print(table(headline))
    load = result["machine"]["load_average_at_start"]
    print(f"\nmachine: {result['machine']['cpu_count']} cores, load average at start {load}; "
          f"{result['duration_s']}s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
