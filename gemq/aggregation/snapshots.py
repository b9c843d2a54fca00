"""The parameter versions the aggregator keeps to compute theta - s exactly."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gemq.config import RunConfig

#: Snapshots kept at the least, whatever the budget: the newest and the one before it.
MIN_KEPT = 2
#: Gradients in flight advised for a model whose snapshots the budget cannot keep for the
#: default max_pending: workers then wait instead of queueing gradients that would go stale.
ADVISED_MAX_PENDING = 4


def kept_versions(config: RunConfig, shard_size: int) -> int:
    """How many snapshots of a shard of ``shard_size`` elements are kept: as many as
    ``max_staleness`` can use, within ``snapshot_budget_mb`` (and ``history``, if set).
    A gradient computed on a version no longer kept is rejected (too_stale or
    snapshot_gone): this number is the run's effective bound on staleness, in versions."""
    by_budget = config.snapshot_budget_mb * 2**20 // max(4 * shard_size, 1)
    kept = min(config.max_staleness + 1, max(MIN_KEPT, by_budget))
    return min(kept, config.history) if config.history else kept


def budget_advice(config: RunConfig, shard_size: int, workers: int) -> str | None:
    """What to tell a user whose snapshot budget rejects gradients that ``workers`` keep in
    flight, and the flags that avoid it; None when the budget keeps enough versions.

    A gradient can be as stale as the gradients queued before it (max_pending) plus those
    being computed (one per worker): max_pending + workers + 1 versions cover it.
    """
    kept = kept_versions(config, shard_size)
    if kept >= min(config.max_pending + workers + 1, config.max_staleness + 1):
        return None
    pending = min(config.max_pending, ADVISED_MAX_PENDING)
    budget_mb = math.ceil((pending + workers + 1) * 4 * shard_size / 2**20)
    flags = " ".join([*([f"--max-pending {pending}"] if pending < config.max_pending else []),
                      f"--snapshot-budget-mb {budget_mb}"])
    stale = f"{kept - 1} update{'s' if kept != 2 else ''}"
    return (f"{kept} parameter snapshots of a shard fit in --snapshot-budget-mb "
            f"{config.snapshot_budget_mb}: gradients more than {stale} stale will be rejected "
            f"(snapshot_gone); for {workers} workers, {flags} keeps every gradient in flight "
            "(README: settings for big models)")


class SnapshotHistory:
    """The last ``limit`` published parameter vectors, by version.

    Snapshots the aggregator published itself are held in memory; after a restart, older
    ones are fetched on demand through ``load`` (they are kept in Redis as well).
    """

    def __init__(self, limit: int, kept: list[int],
                 load: Callable[[int], np.ndarray | None]) -> None:
        self.limit = limit
        self._kept = sorted(kept)
        self._cache: dict[int, np.ndarray] = {}
        self._load = load

    @property
    def versions(self) -> list[int]:
        return list(self._kept)

    def get(self, version: int) -> np.ndarray | None:
        """The snapshot at ``version``, or None when it is no longer kept."""
        cached = self._cache.get(version)
        if cached is not None:
            return cached
        if version not in self._kept:
            return None
        loaded = self._load(version)
        if loaded is not None:
            self._cache[version] = loaded
        return loaded

    def add(self, version: int, params: np.ndarray) -> list[int]:
        """Keep a copy of ``params`` as ``version``; return the versions it displaced."""
        snapshot = params.copy()
        snapshot.flags.writeable = False
        self._cache[version] = snapshot
        self._kept.append(version)
        dropped, self._kept = self._kept[:-self.limit], self._kept[-self.limit:]
        for old in dropped:
            self._cache.pop(old, None)
        return dropped
