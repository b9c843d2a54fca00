"""The parameter versions the aggregator keeps to compute theta - s exactly."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gemq.config import RunConfig

#: Snapshots kept at the least, whatever the budget: the newest and the one before it.
MIN_KEPT = 2


def kept_versions(config: RunConfig, shard_size: int) -> int:
    """How many snapshots of a shard of ``shard_size`` elements are kept: as many as
    ``max_staleness`` can use, within ``snapshot_budget_mb`` (and ``history``, if set).
    A gradient computed on a version no longer kept is rejected (too_stale or
    snapshot_gone): this number is the run's effective bound on staleness, in versions."""
    by_budget = config.snapshot_budget_mb * 2**20 // max(4 * shard_size, 1)
    kept = min(config.max_staleness + 1, max(MIN_KEPT, by_budget))
    return min(kept, config.history) if config.history else kept


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
