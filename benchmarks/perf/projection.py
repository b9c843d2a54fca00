"""A projection, not a measurement: updates/s of S = 1..32 shards with a host per shard,
from the costs per update measured on this machine (benchmarks/perf/shard_sizes.py).

For each model size measured, the run with the fewest shards gives the work one update
costs in all: the CPU seconds of its Redis server and of its aggregators together, and the
bytes its Redis received and sent. With S shards, each on a host of its own (one core for
its Redis master, one for its aggregator, a network link of LINK_BYTES_PER_S each way),
each host does 1/S of that work per update, but never less than the per-update cost that
does not shrink with the shard (``floor``: what the smallest model measured costs per
update, an upper bound of it). A shard's rate is 1 / the largest of its Redis' CPU, its
aggregator's CPU, its bytes in / the link, its bytes out / the link; ``bound_by`` names it.

Assumptions, each a place where it may be wrong:

- Enough workers, on other machines, keep every stream full; shards share nothing, so
  the run's rate is each shard's.
- Work splits evenly: every cost above is proportional to the bytes of a shard, beyond the
  floor. The costs were measured with every process sharing the machine's cores: contention
  (caches, scheduling) is in them, so they err on the slow side.
- The settings are the measured runs' (max_pending and read_batch by model size): a shard
  of a big model still publishes its parameters after every read, as the measured run did.
- The traffic is the transport benchmark's: gradients in, gradients out to the aggregator,
  parameters in once per read batch. Workers' reads of new parameters are not in it; each
  worker that reads every published version adds a shard's bytes per version to the
  out direction of every shard's host.
"""

from __future__ import annotations

from typing import Any

from benchmarks.perf.common import MB
from gemq.shards import MAX_SHARD_BYTES

#: 10 Gbit/s, each way.
LINK_BYTES_PER_S = 10e9 / 8
SHARD_COUNTS = (1, 2, 4, 8, 10, 16, 32)
ROLES = ("redis", "aggregator")


def work(run: dict[str, Any]) -> dict[str, float]:
    """One update's work in a measured run: CPU seconds per role, bytes in and out."""
    cpu = run["cpu_s_per_update"]
    total = {role: sum(v for k, v in cpu.items() if k.startswith(role)) for role in ROLES}
    for direction in ("in", "out"):
        total[direction] = MB * sum(run["net_mb_per_update"][direction])
    return total


def project(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_size: dict[int, dict[str, Any]] = {}
    for run in sorted(runs, key=lambda r: r["shards"], reverse=True):
        by_size[run["parameters"]] = run  # the run with the fewest shards stays
    smallest = by_size[min(by_size)]
    floor = {role: max(v for k, v in smallest["cpu_s_per_update"].items()
                       if k.startswith(role)) for role in ROLES}
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for size, run in sorted(by_size.items()):
        if size == min(by_size):
            continue
        table[f"{size / 1e6:.4g}m"] = _rates(size, work(run), floor)
    return {
        "label": "PROJECTION from per-update costs measured here, not a measurement",
        "link_gbit_per_s": LINK_BYTES_PER_S * 8 / 1e9,
        "floor_ms": {role: round(1e3 * v, 3) for role, v in floor.items()},
        "work_per_update": {f"{size / 1e6:.4g}m": {
            "redis_cpu_ms": round(1e3 * w["redis"], 1),
            "aggregator_cpu_ms": round(1e3 * w["aggregator"], 1),
            "mb_in": round(w["in"] / MB, 1), "mb_out": round(w["out"] / MB, 1)}
            for size, w in ((s, work(r)) for s, r in sorted(by_size.items()))},
        "updates_per_s": table,
    }


def _rates(size: int, total: dict[str, float],
           floor: dict[str, float]) -> dict[int, dict[str, Any]]:
    rates: dict[int, dict[str, Any]] = {}
    for shards in SHARD_COUNTS:
        if 4 * size / shards > MAX_SHARD_BYTES:
            continue
        limits = {role: max(floor[role], total[role] / shards) for role in ROLES}
        limits.update({d: total[d] / shards / LINK_BYTES_PER_S for d in ("in", "out")})
        slowest = max(limits, key=lambda name: limits[name])
        rates[shards] = {"updates_per_s": round(1 / limits[slowest], 2), "bound_by": slowest}
    return rates
