"""Sizing a new run from its model, its workers and its Redis: the values of the settings a
user leaves at ``auto`` (gemq.config.AUTO_SETTINGS), chosen once, when the run is created.

The rules (docs/performance.md, "What gemq chooses", holds the measurements behind them):

- **shards**: the fewest whose values fit one Redis value (MAX_SHARD_BYTES, or less where
  the Redis' ``proto-max-bulk-len`` is lower); on a private Redis Cluster of N masters
  (``gemq run --local-cluster N``), at least N. More shards than that do not pay on one
  machine: their Redis and aggregators share its cores.
- **max_pending and snapshot_budget_mb**: a gradient can be as stale as the gradients queued
  before it (max_pending) and those being computed (one per worker), so a shard needs
  max_pending + workers + 1 snapshots to keep every gradient in flight. The budget stays at
  its default (64 MB) and max_pending takes what that budget leaves, between
  MIN_AUTO_PENDING and the default 64 (so a small model keeps today's 64); a budget that
  cannot keep MIN_AUTO_PENDING's versions grows to keep them.
- **wire_dtype and publish_every**: bfloat16 gradients and new parameters every second
  update from BYTE_SAVING_FROM bytes of state, where moving bytes costs as much as
  computing; float32 and every update below it.
- **Redis memory**: ``redis_bytes`` bounds what the run can make its Redis hold. Where the
  room is known (a Redis' ``maxmemory``; for a private Redis, a third of the memory this
  machine has available), max_pending shrinks, then the budget with it, until the bound
  fits; a run that still does not fit a maxmemory is refused (RunTooBig) with what it
  needs, and one over the machine's share gets a warning (the bound is a worst case).

A value the user gave is kept as given, and only checked against the room.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from gemq.aggregation.snapshots import MIN_KEPT, kept_versions
from gemq.config import AUTO_SETTINGS, PROXY_STATE_VECTORS, RunConfig, proxy_state_bytes
from gemq.errors import GemqError
from gemq.layout import ParamLayout
from gemq.shards import MAX_SHARD_BYTES, ShardPlan
from gemq.state.serverfit import BULK_LEN_SLACK, ServerFacts
from gemq.wire.codec import HEADER_ALLOWANCE, WIRE_DTYPES

log = logging.getLogger(__name__)

MB = 2**20
#: RunConfig's defaults: its snapshot budget is the reference every auto max_pending is
#: sized within.
DEFAULTS = RunConfig(run_id="defaults")
DEFAULT_BUDGET_MB = DEFAULTS.snapshot_budget_mb
DEFAULT_PENDING = DEFAULTS.max_pending
#: The fewest gradients in flight auto chooses while the Redis has room: measured for the
#: 11.4 M-parameter MLP, 4 keeps both workers busy (docs/performance.md).
MIN_AUTO_PENDING = 4
#: From this many bytes of state, gradients travel as bfloat16 and parameters are published
#: every BYTE_SAVING_PUBLISH_EVERY updates (measured at 45.6 MB: the same accuracy at more
#: updates/s, docs/performance.md "What gemq chooses"; below it, no measurement shows a
#: gain worth changing what the model sees).
BYTE_SAVING_FROM = 32 * MB
BYTE_SAVING_DTYPE = "bfloat16"
BYTE_SAVING_PUBLISH_EVERY = 2
#: Redis' allocator (jemalloc) rounds a large value up to its size class, four per
#: doubling: a value takes up to 1.25 times its bytes.
ALLOCATED = 1.25
#: What a Redis holds beyond a run's values: its own baseline, the run's metrics (capped
#: at METRICS_MAXLEN rows of a few hundred bytes), bookkeeping.
REDIS_BASE_BYTES = 32 * MB
#: A private Redis may take this share of the memory the machine has available: the
#: aggregators keep as many snapshots again in their own memory, and the workers need theirs.
PRIVATE_REDIS_SHARE = 1 / 3


class RunTooBig(GemqError):
    """The run cannot fit the Redis it is created on; the message says what it needs."""


@dataclass(frozen=True)
class Room:
    """Where the run's values go: bytes free for it (None: unknown, no bound) on each of
    ``masters`` (a Redis Cluster's masters each have their own maxmemory, and the shards
    spread over them), what that figure is (for messages), the largest value one write may
    carry, and the fewest shards (one per master of a private cluster)."""

    free_bytes: int | None
    source: str
    value_limit: int = MAX_SHARD_BYTES + BULK_LEN_SLACK
    masters: int = 1
    min_shards: int = 1
    #: A Redis' maxmemory is a wall (writes past it are refused): a run over it is refused.
    #: This machine's memory is a guide: a run over it is warned about.
    strict: bool = True

    def fits(self, config: RunConfig, needed: int) -> bool:
        """Whether a run needing ``needed`` bytes in all fits: a master holds at most
        ceil(shards / masters) of its shards."""
        if self.free_bytes is None:
            return True
        share = math.ceil(config.shards / self.masters) / config.shards
        return math.ceil(needed * min(share, 1.0)) <= self.free_bytes

    @classmethod
    def of_server(cls, facts: ServerFacts | None) -> Room:
        """The room of a Redis the user brings (unknown where it refused CONFIG GET)."""
        if facts is None:
            return cls(None, "the Redis' settings could not be read")
        limit = min(facts.value_limit, MAX_SHARD_BYTES + BULK_LEN_SLACK)
        if not facts.maxmemory:
            return cls(None, "the Redis sets no maxmemory", limit, facts.masters)
        free = max(facts.maxmemory - facts.used_memory, 0)
        return cls(free, f"its maxmemory {facts.maxmemory / MB:.0f} MB with "
                         f"{facts.used_memory / MB:.0f} MB used", limit, facts.masters)

    @classmethod
    def of_this_machine(cls, masters: int = 1) -> Room:
        """A private Redis (or cluster of ``masters``) on this machine: a share of the
        memory available, for all its masters together."""
        available = available_memory()
        return cls(int(available * PRIVATE_REDIS_SHARE),
                   f"a third of the {available / 2**30:.1f} GB this machine has available",
                   min_shards=masters, strict=False)


@dataclass(frozen=True)
class Sizing:
    """The run's config with every auto setting chosen, and why."""

    config: RunConfig
    #: The settings gemq chose, in AUTO_SETTINGS order.
    chosen: tuple[str, ...]
    state_bytes: int
    #: Elements of the run's largest shard.
    shard_size: int
    workers: int
    #: What the run can make its Redis hold at most (``redis_bytes``).
    redis_bytes: int
    room: Room
    notes: list[str] = field(default_factory=list)

    def differs_from_defaults(self) -> bool:
        """Whether a chosen value is not RunConfig's default: then worth saying."""
        return any(getattr(self.config, name) != getattr(DEFAULTS, name)
                   for name in self.chosen)

    def describe(self) -> str:
        """One short block: what was chosen, and why."""
        c = self.config
        shard_mb = self.state_bytes / c.shards / MB
        lines = [f"sized for a {self.state_bytes / MB:.1f} MB model and {self.workers} "
                 f"worker{'s' if self.workers != 1 else ''} (flags given win):"]
        if "shards" in self.chosen:
            why = ("one per master of the private cluster" if c.shards == self.room.min_shards > 1
                   else "the fewest that hold it")
            lines.append(f"  shards {c.shards}: {why} ({shard_mb:.1f} MB each)")
        versions = kept_versions(c, self.shard_size)
        if {"max_pending", "snapshot_budget_mb"} & set(self.chosen):
            lines.append(f"  max_pending {c.max_pending}, snapshots {c.snapshot_budget_mb} MB "
                         f"a shard ({versions} versions: max_pending + workers + 1 keeps "
                         "every gradient in flight)")
        if {"wire_dtype", "publish_every"} & set(self.chosen):
            big = self.state_bytes >= BYTE_SAVING_FROM
            why = f"{'from' if big else 'under'} {BYTE_SAVING_FROM // MB} MB of parameters"
            if big and c.publish_every < BYTE_SAVING_PUBLISH_EVERY:
                why += f"; every update while max_pending is under {2 * BYTE_SAVING_PUBLISH_EVERY}"
            lines.append(f"  {c.wire_dtype} gradients, parameters {_every(c.publish_every)} "
                         f"({why})")
        lines.extend(f"  {note}" for note in self.notes)
        lines.append(f"  Redis memory: at most {_size(self.redis_bytes)}"
                     + (f" of {_size(self.room.free_bytes)} free ({self.room.source})"
                        if self.room.free_bytes is not None else ""))
        return "\n".join(lines)


def size_run(config: RunConfig, left_to_gemq: Collection[str], layout: ParamLayout,
             workers: int, room: Room) -> Sizing:
    """``config`` with the settings in ``left_to_gemq`` chosen for ``layout``'s model,
    ``workers`` workers and ``room``; RunTooBig if it cannot fit, ConfigError for given
    values that cannot hold the model."""
    chosen = tuple(name for name in AUTO_SETTINGS if name in left_to_gemq)
    state_bytes = 4 * layout.size
    notes: list[str] = []
    if "shards" in chosen:
        # A worker's proxy state is one value too: twice the parameters' with Adam.
        largest = proxy_state_bytes(config, layout.size)
        config = config.replace(shards=_fewest_shards(largest, room))
    plan = ShardPlan.of(layout, config.shards)  # a given count that cannot hold it: refused
    shard_size = max(shard.size for shard in plan.shards)
    if "wire_dtype" in chosen:
        big = state_bytes >= BYTE_SAVING_FROM
        config = config.replace(wire_dtype=BYTE_SAVING_DTYPE if big else "float32")
    config = _in_flight(config, chosen, shard_size, workers)
    if "publish_every" in chosen:
        config = config.replace(publish_every=_publish_every(config, state_bytes))
    config, shrunk = _fit(config, chosen, plan, workers, room)
    if shrunk:
        notes.append(f"fewer in flight to fit the Redis: max_pending {config.max_pending}")
    needed = redis_bytes(config, plan, workers)
    if not room.fits(config, needed):
        if room.strict:
            raise RunTooBig(_too_big(config, state_bytes, workers, needed, room))
        log.warning("this run may make its Redis hold up to %s (%s), more than %s: the "
                    "machine may run short of memory; fewer workers, or a smaller "
                    "--max-pending or --snapshot-budget-mb, need less", _size(needed),
                    _settings_text(config, state_bytes, workers), room.source)
    return Sizing(config, chosen, state_bytes, shard_size, workers, needed, room, notes)


def redis_bytes(config: RunConfig, plan: ShardPlan, workers: int) -> int:
    """The most the run can make its Redis hold, summed over the shards: per shard, the
    snapshots kept; the gradients in the stream (max_pending, and one more per worker that
    saw room at the same moment), the same again in the aggregator's read replies, and one
    per worker on its way in (a client's query buffer); the workers' GEM moments (two
    vectors each for an Adam proxy) and one being staged; a staged parameter vector; a read
    of the parameters per worker and one more (the model file); each value rounded up to
    its allocation; and the server's own base with the run's capped metrics."""
    total = 0
    for shard in plan.shards:
        state = 4 * shard.size
        gradient = shard.size * WIRE_DTYPES[config.wire_dtype].itemsize + HEADER_ALLOWANCE
        gradients = 2 * (config.max_pending + workers) + workers
        moments = (workers + 1) * PROXY_STATE_VECTORS[config.optimizer]
        states = kept_versions(config, shard.size) + moments + 1 + (workers + 1)
        total += math.ceil(ALLOCATED * (states * state + gradients * gradient))
    return total + REDIS_BASE_BYTES


def _fewest_shards(state_bytes: int, room: Room) -> int:
    per_shard = min(MAX_SHARD_BYTES, room.value_limit - BULK_LEN_SLACK)
    if per_shard < 4:
        raise RunTooBig(f"the Redis takes values of at most {room.value_limit} bytes "
                        "(proto-max-bulk-len): too few to hold a shard")
    return max(math.ceil(state_bytes / per_shard), room.min_shards, 1)


def _in_flight(config: RunConfig, chosen: tuple[str, ...], shard_size: int,
               workers: int) -> RunConfig:
    """max_pending within the budget's snapshots (the default budget, unless one was
    given), and a budget for it."""
    shard_bytes = 4 * shard_size
    if "max_pending" in chosen:
        covered = config.snapshot_budget_mb * MB // shard_bytes - workers - 1
        pending = min(DEFAULT_PENDING, max(MIN_AUTO_PENDING, covered))
        config = config.replace(max_pending=pending)
    if "snapshot_budget_mb" in chosen:
        config = config.replace(snapshot_budget_mb=_budget_mb(config, shard_bytes, workers))
    return config


def _budget_mb(config: RunConfig, shard_bytes: int, workers: int,
               at_least_mb: int = DEFAULT_BUDGET_MB) -> int:
    """What max_pending + workers + 1 versions need (within what max_staleness can use), or
    ``at_least_mb`` if more: the default budget, or nothing for a Redis short of room."""
    versions = min(config.max_pending + workers + 1, config.max_staleness + 1)
    return max(at_least_mb, math.ceil(max(versions, MIN_KEPT) * shard_bytes / MB))


def _publish_every(config: RunConfig, state_bytes: int) -> int:
    if state_bytes < BYTE_SAVING_FROM:
        return 1
    # An open publication window holds its gradients in the stream (RunConfig's check).
    return min(BYTE_SAVING_PUBLISH_EVERY, max(1, config.max_pending // 2))


def _fit(config: RunConfig, chosen: tuple[str, ...], plan: ShardPlan, workers: int,
         room: Room) -> tuple[RunConfig, bool]:
    """Fewer gradients in flight (and snapshots for them) until the run fits ``room``;
    only where gemq chose them."""
    if room.free_bytes is None or "max_pending" not in chosen:
        return config, False
    shard_bytes = 4 * max(shard.size for shard in plan.shards)
    shrunk = False
    while config.max_pending > 1 and not room.fits(config, redis_bytes(config, plan, workers)):
        pending = config.max_pending - 1
        # An open publication window holds its gradients in the stream (RunConfig's check).
        config = config.replace(max_pending=pending,
                                publish_every=min(config.publish_every, max(1, pending // 2)))
        if "snapshot_budget_mb" in chosen:
            config = config.replace(
                snapshot_budget_mb=_budget_mb(config, shard_bytes, workers, at_least_mb=0))
        shrunk = True
    return config, shrunk


def _settings_text(config: RunConfig, state_bytes: int, workers: int) -> str:
    return (f"{state_bytes / MB:.0f} MB of parameters, {config.shards} "
            f"shard{'s' if config.shards > 1 else ''}, {workers} "
            f"worker{'s' if workers != 1 else ''}, max_pending {config.max_pending}, "
            f"snapshots {config.snapshot_budget_mb} MB a shard")


def _too_big(config: RunConfig, state_bytes: int, workers: int, needed: int,
             room: Room) -> str:
    return (f"this run needs up to {_size(needed)} of Redis memory "
            f"({_settings_text(config, state_bytes, workers)}) and the "
            f"Redis has {_size(room.free_bytes or 0)} free ({room.source}): raise its "
            f"maxmemory by {_size(needed - (room.free_bytes or 0))} or more, or run fewer "
            "workers or more shards over a Redis Cluster")


def available_memory() -> int:
    """Bytes this machine has available (Linux' MemAvailable; all of it elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _every(n: int) -> str:
    """1 -> "every update", 2 -> "every 2nd update"."""
    if n == 1:
        return "every update"
    suffix = {2: "nd", 3: "rd"}.get(n, "th")
    return f"every {n}{suffix} update"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / MB:.0f} MB"
