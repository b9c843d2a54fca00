"""The transport with shards at 11 M parameters: what a second shard buys.

Configurations of the same 11 M-parameter GEM run, fed by the same 2 producer processes
at full speed (benchmarks/perf/sharded.py):

- ``s1``: one shard on one Redis (today's run);
- ``s2_two_redis``: two shards on two Redis servers (a Redis Cluster of 2 masters, one
  shard on each), an aggregator process per shard;
- ``s2_one_redis``: two shards on one Redis, an aggregator process per shard;
- ``s1_release_pages``, ``s2_two_redis_release_pages``: s1 and s2_two_redis with Redis'
  allocator handing the memory it frees back to the kernel at once (jemalloc's defaults,
  sharded.RELEASE_PAGES), as gemq's private Redis did before it kept freed pages
  (gemq.running.embedded.KEEP_FREED_PAGES): then Redis spends most
  of its CPU in the kernel, faulting in fresh pages for every multi-megabyte value.

Each is measured twice, interleaved (A B C D E A B C D E): a ratio uses the mean of both,
and the spread of the pairs shows the machine's drift. ``shards_speedup.*`` compares two
configurations' updates/s (``RATIOS``); the target is >= 1.6 for ``two_redis``
(s2_two_redis over s1).

On a machine with fewer cores than busy processes (2 producers, S aggregators, S Redis
servers: 4 for s1, 6 for s2_two_redis), every configuration shares the same cores and the
rate follows the CPU spent per update, whoever spends it. So the CPU seconds per update of
each process are measured too. ``shards_core_bound_speedup.*`` compares what the
configurations would reach with a core for every Redis server and every aggregator:
1 / (the busiest of those processes' CPU seconds per update), producers not counted (the
cores they would need at that rate are reported beside it). It is a projection from
measured costs, not a measurement. ``shards_cpu_speedup.*`` is the other end: the CPU
seconds per update, every process together, of the compared configuration over this
one's, which is the speedup when all processes share the same cores (other tenants'
load cancels out).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.perf.common import Budget, ratio
from benchmarks.perf.sharded import busiest, measure, role_total

NAME = "shards"
SIZE = 11_000_000
#: name -> (shards, masters (0: one plain Redis), whether Redis hands freed pages back)
CONFIGS = {"s1": (1, 0, False), "s2_two_redis": (2, 2, False), "s2_one_redis": (2, 0, False),
           "s1_release_pages": (1, 0, True), "s2_two_redis_release_pages": (2, 2, True)}
#: ratio name -> (configuration, the configuration it is compared with)
RATIOS = {"two_redis": ("s2_two_redis", "s1"), "one_redis": ("s2_one_redis", "s1"),
          "two_redis_release_pages": ("s2_two_redis_release_pages", "s1_release_pages"),
          "keep_pages": ("s1", "s1_release_pages")}


def run(budget: Budget) -> dict[str, Any]:
    size = budget.pick(SIZE, 1_000_000)
    window_s = budget.seconds(10.0, 1.5)
    rounds = budget.pick(2, 1)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for _ in range(rounds):
        for name, (shards, masters, release_pages) in CONFIGS.items():
            runs[name].append(measure(size, shards, masters, window_s,
                                      release_pages=release_pages))
    return summarise(runs)


def core_bound(result: dict[str, Any]) -> float:
    """Updates/s with one core for each Redis server and each aggregator (a projection)."""
    return 1.0 / max(busiest(result, "redis"), busiest(result, "aggregator"))


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def mean(name: str, of: Any) -> float:
        return statistics.fmean(of(r) for r in runs[name])

    rates = {name: mean(name, lambda r: r["updates_per_s"]) for name in runs}
    bounds = {name: mean(name, core_bound) for name in runs}
    cpu = {name: mean(name, lambda r: sum(r["cpu_s_per_update"].values())) for name in runs}
    pairs = {key: pair for key, pair in RATIOS.items() if all(name in runs for name in pair)}
    return {
        "shards_speedup": {key: ratio(rates[a], rates[b]) for key, (a, b) in pairs.items()},
        "shards_speedup_spread": {
            key: [ratio(x["updates_per_s"], y["updates_per_s"])
                  for x, y in zip(runs[a], runs[b], strict=True)]
            for key, (a, b) in pairs.items()},
        "shards_core_bound_speedup": {key: ratio(bounds[a], bounds[b])
                                      for key, (a, b) in pairs.items()},
        # The CPU seconds per update of the compared configuration, all its processes
        # together, over this one's: the speedup when every process shares the same cores,
        # whatever other tenants take.
        "shards_cpu_speedup": {key: ratio(cpu[b], cpu[a]) for key, (a, b) in pairs.items()},
        "configurations": {name: {
            "updates_per_s": round(rates[name], 3),
            "cpu_s_per_update": round(cpu[name], 4),
            "core_bound_updates_per_s": round(bounds[name], 2),
            # What the producers would need to keep up with that rate, in cores.
            "producer_cores_at_core_bound": round(
                bounds[name] * mean(name, lambda r: role_total(r, "producer")), 2)}
            for name in runs},
        "runs": runs,
    }
