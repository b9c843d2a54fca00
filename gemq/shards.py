"""Shards: a run's flat state cut into contiguous ranges, each aggregated on its own.

GEM is element-wise: an element's update depends only on its own gradient, moment, value
and snapshot, and a buffer element's on its own change, value, snapshot and momentum. Any
partition of the flat state therefore gives the same result, shard by shard, as the whole
vector at once (docs/design.md). Each shard has its own keys in Redis (gemq/state/keys.py:
its own hash tag, which on a Redis Cluster gemq/state/placement.py chooses so the shards
spread over the masters), its own gradient stream, versions, lease and commits, and its own
aggregator.

Cuts fall at tensor boundaries where that keeps the shards within a tenth of equal size,
inside a tensor otherwise. No shard's values (its parameter snapshot, a gradient message)
exceed MAX_SHARD_BYTES, well under Redis' 512 MB limit: a larger model needs more shards.
"""

from __future__ import annotations

import builtins
import math
from dataclasses import dataclass

import numpy as np

from gemq.errors import ConfigError
from gemq.layout import ParamLayout, Tensor

#: The largest shard, in float32 bytes (about 16.7 M elements): its snapshot is one Redis
#: value of this size, a gradient message this plus a header. The proto-max-bulk-len of the
#: shipped Redis configuration (k8s/base/config/redis.conf: 65mb) admits it.
MAX_SHARD_BYTES = 64 * 1024 * 1024
#: A cut moves to a tensor boundary when that keeps the shard within this share of equal.
BOUNDARY_SLACK = 0.1


@dataclass(frozen=True)
class Shard:
    """Elements [start, stop) of the flat state: parameters up to ``param_stop``, then
    buffers (the state holds all parameters before any buffer)."""

    index: int
    count: int
    start: int
    stop: int
    param_stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def param_size(self) -> int:
        return self.param_stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    def buffer_momenta(self, layout: ParamLayout) -> np.ndarray | None:
        """The momentum of each buffer element this shard holds (ParamLayout.buffer_momenta),
        in the order of the shard's vector after its parameters; None if all are 0."""
        base = layout.param_size
        return layout.buffer_momenta(self.param_stop - base, self.stop - base)

    def tensors(self, layout: ParamLayout) -> list[tuple[Tensor, builtins.slice]]:
        """The parameter tensors this shard holds part of, each with that part's range in
        the shard's own vector."""
        parts = []
        for t in layout.params:
            low, high = max(t.offset, self.start), min(t.offset + t.size, self.param_stop)
            if low < high:
                parts.append((t, slice(low - self.start, high - self.start)))
        return parts


@dataclass(frozen=True)
class ShardPlan:
    layout_id: str
    shards: tuple[Shard, ...]

    @classmethod
    def of(cls, layout: ParamLayout, count: int) -> ShardPlan:
        """``count`` shards of ``layout``; ConfigError if that cannot be done."""
        size = layout.size
        if count > max(size, 1):
            raise ConfigError("shards", f"{count} shards for a state of {size} elements")
        needed = math.ceil(4 * size / MAX_SHARD_BYTES)
        if count < needed:
            raise ConfigError("shards", f"the model's state is {4 * size / 2**20:.0f} MB; "
                                        f"shards hold at most {MAX_SHARD_BYTES // 2**20} MB, "
                                        f"so it needs --shards {needed} or more")
        cuts = [0, *(_cut(layout, size * k / count, size / count) for k in range(1, count)),
                size]
        if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):  # few, large tensors
            cuts = [round(size * k / count) for k in range(count + 1)]
        shards = tuple(Shard(k, count, cuts[k], cuts[k + 1],
                             min(max(cuts[k], layout.param_size), cuts[k + 1]))
                       for k in range(count))
        return cls(layout.layout_id, shards)

    @property
    def count(self) -> int:
        return len(self.shards)

    @property
    def size(self) -> int:
        """Elements of the whole state."""
        return self.shards[-1].stop

    def layout_id_of(self, shard: int) -> str:
        """What a shard's gradient messages carry as their layout id: the run's own for one
        shard; with the shard's place otherwise, so a slice can never be taken for another
        shard's, or another layout's."""
        if self.count == 1:
            return self.layout_id
        return f"{self.layout_id}:{shard}/{self.count}"


def _cut(layout: ParamLayout, ideal: float, shard_size: float) -> int:
    """The tensor boundary nearest to ``ideal`` if it is close enough, else ``ideal``."""
    boundaries = [t.offset for t in layout.tensors[1:]]
    nearest = min(boundaries, key=lambda b: abs(b - ideal), default=None)
    if nearest is not None and abs(nearest - ideal) <= BOUNDARY_SLACK * shard_size:
        return nearest
    return round(ideal)
