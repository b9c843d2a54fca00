"""Where the CPU goes, per worker step: Redis, the aggregator and each worker process.

    python -m benchmarks.perf.cpu --workers 2 [--seconds 8] [--set publish_interval_ms=25]

Runs the whole system as the compute benchmark does (paper CNN, batch 64), then reads each
process's CPU time (user + system, from the kernel) over a window and divides by the
gradients published in it. Not part of the suite: it explains the compute ratio (on two
cores, the workers' share of the CPU is what is left after Redis and the aggregator), it
does not judge it. Like every rate here, the milliseconds drift with the machine; their
split within one window is the evidence.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import psutil

from benchmarks.perf.common import private_redis
from benchmarks.perf.system import counter, finish, launch
from gemq.config import RunConfig


def cpu_per_step(workers: int, seconds: float, settings: dict[str, Any]) -> dict[str, Any]:
    config = RunConfig(run_id=f"bench-cpu-n{workers}", batch_size=64, budget_updates=10**9,
                       **settings)
    with private_redis() as (server, client):
        system = launch(server.url, client, config, workers)
        try:
            time.sleep(2.0)  # past the first parameter reads
            pids = {"redis": server.process.pid if server.process else 0, **system.pids}
            processes = {label: psutil.Process(pid) for label, pid in pids.items()}
            before = {label: _cpu_s(p) for label, p in processes.items()}
            steps0, t0 = counter(system.store, "published"), time.monotonic()
            time.sleep(seconds)
            after = {label: _cpu_s(p) for label, p in processes.items()}
            steps, elapsed = counter(system.store, "published") - steps0, time.monotonic() - t0
            rows = system.store.latest_metrics(50)
        finally:
            finish(system)
    used = {label: after[label] - before[label] for label in processes}
    applied = [r for _, r in rows if int(r["applied"])]
    return {
        "steps_per_s": round(steps / elapsed, 1),
        "cpu_ms_per_step": {label: round(s / steps * 1000, 3) for label, s in used.items()},
        "cpu_share": {label: round(s / elapsed, 3) for label, s in used.items()},
        "total_cpu_ms_per_step": round(sum(used.values()) / steps * 1000, 3),
        "total_cpu_share": round(sum(used.values()) / elapsed, 3),
        "mean_staleness": round(statistics.fmean(float(r["staleness_mean"]) for r in applied), 2)
        if applied else None,
        "mean_updates_per_commit": round(statistics.fmean(int(r["applied"]) for r in applied), 2)
        if applied else None,
    }


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _setting(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    return name, int(value) if value.isdigit() else value


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf.cpu",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--set", action="append", default=[], type=_setting,
                        metavar="FIELD=VALUE", help="a RunConfig field (repeatable)")
    args = parser.parse_args()
    result = cpu_per_step(args.workers, args.seconds, dict(args.set))
    print(f"{args.workers} workers: {result['steps_per_s']} steps/s, mean staleness "
          f"{result['mean_staleness']}, {result['mean_updates_per_commit']} updates/commit")
    for label, ms in result["cpu_ms_per_step"].items():
        print(f"  {label:18s} {ms:6.2f} ms CPU per step  ({result['cpu_share'][label]:.0%} "
              "of a core)")
    print(f"  {'total':18s} {result['total_cpu_ms_per_step']:6.2f} ms CPU per step  "
          f"({result['total_cpu_share']:.0%} of a core)")


if __name__ == "__main__":
    main()
