"""A run's numbers from its shards' (gemq/shards.py): what the summary, the progress bar,
the API and the model file show for a sharded run.

Every shard counts the slices it receives: a gradient published to a run of S shards is S
slices, each applied or rejected by its own shard's aggregator. The run counts a gradient
applied once every shard has applied its slice, so the run's ``applied`` and ``published``
are the smallest of the shards'; a rejection counts once if any shard rejected (the largest
per reason); the run's version is its slowest shard's. For a run of one shard, each of these
is simply that shard's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gemq.state.store import ENDED, Head, RunStore

#: Counters where the run's value is the smallest over its shards (a gradient counts once
#: all of its slices do); every other counter takes the largest.
SMALLEST = frozenset({"applied", "published"})


def counters(stores: Sequence[RunStore]) -> dict[str, int]:
    """The run's counters (see the module's docstring)."""
    per_shard = [store.counters() for store in stores]
    if len(per_shard) == 1:
        return per_shard[0]
    names = {name for shard in per_shard for name in shard}
    return {name: (min if name in SMALLEST else max)(shard.get(name, 0) for shard in per_shard)
            for name in sorted(names)}


def unused(stores: Sequence[RunStore], counts: dict[str, int]) -> int:
    """Gradients an ended run will never apply: those counted when its streams were emptied
    at its end, and any published after that (still in a stream: a worker's publication
    can cross the run's end)."""
    return counts.get("unused", 0) + max(store.unconsumed() for store in stores)


def heads(stores: Sequence[RunStore]) -> list[Head]:
    return [store.head() for store in stores]


def slowest(heads: Sequence[Head]) -> Head:
    """The head of the shard that applied the fewest updates: the run's progress."""
    return min(heads, key=lambda head: head.updates)


def latest_state(stores: Sequence[RunStore]) -> tuple[tuple[int, ...], np.ndarray]:
    """Each shard's newest version and the whole state, put together from their slices
    (each slice as of its own shard's newest version)."""
    parts = [store.latest() for store in stores]
    versions = tuple(version for version, _ in parts)
    if len(parts) == 1:
        return versions, parts[0][1]
    return versions, np.concatenate([params for _, params in parts])


def shard_table(stores: Sequence[RunStore],
                shard_heads: Sequence[Head] | None = None) -> list[dict[str, Any]]:
    """One row per shard: its version, counts, its leader (the lease holder's token, None
    while no aggregator leads it), its backlog (slices in its stream not yet committed:
    what worker backpressure compares with max_pending; 0 once the shard has ended, when
    what is left there is counted unused), and its aggregator's latest energy
    ratio, median pi and staleness (for a sharded run's views). ``shard_heads``: heads the
    caller read already, so that its progress and the table agree."""
    table = []
    for store, head in zip(stores, shard_heads or heads(stores), strict=True):
        shard_counters = store.counters()
        latest = store.latest_metrics(1)
        row = latest[0][1] if latest else {}
        table.append({
            "shard": store.shard, "version": head.version, "updates": head.updates,
            "state": head.state, "leader": store.leader(),
            "backlog": 0 if head.state in ENDED else store.step_view().pending,
            "applied": shard_counters.get("applied", 0),
            "rejected": sum(v for k, v in shard_counters.items() if k.startswith("rejected:")),
            "energy_ratio": _number(row.get("energy_ratio")),
            "median_pi": _number(row.get("median_pi")),
            "staleness_mean": _number(row.get("staleness_mean")),
            # The latest batch's energies per update, which the run-wide ratio sums.
            "e_central": _per_update(row, "e_central"),
            "e_proxy": _per_update(row, "e_proxy"),
        })
    return table


def overall(table: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run-wide row of a shard table, from every shard's latest batch.

    GEM's energies are sums over the parameters, so the whole vector's are the sums of its
    shards' (per update, as the shards' batches hold different numbers of updates): the
    run's energy ratio is theirs summed, not a mean of ratios. Staleness: the mean and the
    largest of the shards' means. Median pi: medians do not combine, so the lowest and
    highest of the shards'. None where a shard has measured nothing yet.
    """
    def measured(field: str) -> list[float] | None:
        values = [shard[field] for shard in table]
        return values if values and all(v is not None for v in values) else None

    central, proxy = measured("e_central"), measured("e_proxy")
    staleness, pis = measured("staleness_mean"), measured("median_pi")
    return {
        "energy_ratio": (sum(central) / sum(proxy)
                         if central is not None and proxy is not None and sum(proxy) > 0
                         else None),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
        "staleness_mean_max": max(staleness) if staleness else None,
        "median_pi_range": [min(pis), max(pis)] if pis else None,
    }


def _per_update(row: Mapping[str, str], field: str) -> float | None:
    value, updates = _number(row.get(field)), int(row.get("applied", 0) or 0)
    return value / updates if value is not None and updates > 0 else None


def _number(text: Any) -> float | None:
    if text is None:
        return None
    value = float(text)
    return None if value != value else value  # NaN: nothing measured yet
