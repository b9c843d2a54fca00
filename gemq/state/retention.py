"""What Redis keeps of a run once it has ended, deleting runs, and how many are kept.

While a run trains it needs, besides its state, things only training uses: the last
``history`` parameter snapshots (theta - s for stale gradients), the gradient stream, the
GEM moments checkpointed for a new leader. Once it has ended (finished, stopped, failed)
nothing reads them again: ``release_training_state`` drops them and keeps the final
parameters and buffers, configuration, layout, status, head, counters, worker table and
metrics stream, so the dashboard, ``gemq status``, the model download and warm starts from
it work as before. Aggregators call it as they leave a run they ended
(``release_if_ended``); the API service's sweep (``apply_retention``) frees any run they
could not, and deletes the ended runs a ``RetentionPolicy`` does not keep.

``delete_run`` first claims the run in one atomic script (scripts.CLAIM_DELETION), refused
while anything may still write to it; then every key of the run, of every shard, is found
by SCAN and unlinked; its entry in the run index goes last, so that a deletion cut short
is finished by the next one or by the sweep.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import redis

from gemq.errors import GemqError, RunBusy, RunNotFound
from gemq.ids import is_valid_run_id
from gemq.state import scripts
from gemq.state.keys import (
    AGGREGATOR_GROUP,
    RUNS_INDEX,
    RunKeys,
    deletion_marker,
    run_key_pattern,
)
from gemq.state.store import ENDED, RunStore, now_ms

log = logging.getLogger(__name__)

#: How long a deletion's marker lives: a deletion cut short (its process died) is finished
#: by the next one to come after this; one under way makes the others a 404.
DELETION_MARKER_MS = 60_000
#: Keys asked for per SCAN call, and unlinked per round trip.
SCAN_BATCH = 1000
DAY_MS = 86_400_000


# --- an ended run keeps its results, not its training state ------------------------------

def release_training_state(store: RunStore) -> bool:
    """Drop what ``store``'s run kept only for training, once it has ended; False (and
    nothing done) while it has not, or when it is gone. Safe to repeat.

    Only deletions come first: Redis allows them when it is out of memory, and what they
    free lets the rest (which writes) through.
    """
    keys, client = store.keys, _untyped(store.client)
    try:
        head = store.head()
        # A shard ends with its final commit; the run once every shard has (or one failed).
        if head.state not in ENDED and store.state() not in ENDED:
            return False
        final = head.version
    except RunNotFound:
        return False
    old = [v for v in store.kept_versions() if v != final]
    moments = [keys.moment(w.decode()) for w in client.hkeys(keys.moments)]
    pipe = client.pipeline(transaction=True)
    if old:
        pipe.delete(*[keys.params(v) for v in old])
        pipe.zrem(keys.versions, *old)
    pipe.delete(keys.moments, *moments)
    pipe.execute()
    _drain_gradients(store)
    return_freed_memory(client)
    return True


def return_freed_memory(client: redis.Redis) -> None:
    """Have Redis' allocator hand the pages it keeps back to the kernel (MEMORY PURGE; on a
    cluster, every node). gemq's own Redis keeps freed pages for the next large value
    (gemq.running.embedded.KEEP_FREED_PAGES), so without this its memory would stay at the peak of
    runs that are over. A server without the command keeps what it has."""
    try:
        client.memory_purge()
    except redis.ResponseError as e:
        log.debug("MEMORY PURGE refused: %s", e)


def _drain_gradients(store: RunStore) -> None:
    """Empty the ended run's gradient stream (gradients published after its last read),
    adding them to the ``unused`` counter: the run's summary counts unused gradients as that
    counter plus the stream's unconsumed entries, so its totals stay what they were. An
    empty stream and its group are left in place for that count."""
    keys = store.keys

    def drain(pipe: Any) -> None:
        # WATCHed (the shard's keys only: one Cluster slot): a late publication, or a
        # deletion, in between makes EXEC fail; redis-py then runs this again on what is
        # there now. The shard has ended (the caller checked): that never changes.
        if not pipe.exists(keys.head) or not pipe.xlen(keys.gradients):
            return
        unused = store.unconsumed()
        pipe.multi()
        if unused:
            pipe.hincrby(keys.counters, "unused", unused)
        pipe.delete(keys.gradients)
        pipe.xgroup_create(keys.gradients, AGGREGATOR_GROUP, id="0", mkstream=True)

    store.client.transaction(drain, keys.head, keys.gradients)


def release_if_ended(store: RunStore, outcome: str) -> None:
    """An aggregator's last step, given what its ``run()`` returned: free the run's training
    state if the run has ended. Redis errors are logged, not raised: the outcome is what
    the caller reports, and the API service's sweep frees what this could not."""
    if outcome not in ENDED:
        return
    try:
        release_training_state(store)
    except (redis.RedisError, GemqError) as e:
        log.warning("run %s: could not free its training state (%s); the API service's "
                    "retention sweep frees it later", store.run_id, e)


def holds_training_state(client: redis.Redis, shards: list[RunKeys]) -> list[bool]:
    """Whether each shard still holds something ``release_training_state`` would drop (old
    snapshots, moments, gradients), in one round trip."""
    pipe = _untyped(client).pipeline(transaction=False)
    for keys in shards:
        pipe.zcard(keys.versions)
        pipe.exists(keys.moments)
        pipe.xlen(keys.gradients)
    replies = pipe.execute()
    return [replies[i] > 1 or bool(replies[i + 1] or replies[i + 2])
            for i in range(0, len(replies), 3)]


def _shard_stores(client: redis.Redis, run_ids: list[str]) -> list[RunStore]:
    """A store of every shard of each run (its configuration, and placed tags if it has
    several shards, read once each)."""
    shards = []
    for run_id in run_ids:
        with contextlib.suppress(RunNotFound):
            shards += RunStore(client, run_id).shards()
    return shards


# --- deleting a run ----------------------------------------------------------------------

@dataclass(frozen=True)
class Deleted:
    run_id: str
    #: Keys unlinked.
    keys: int
    #: The rq job that was to aggregate the run, if any: the caller's to forget.
    job_id: str | None


def delete_run(client: redis.Redis, run_id: str, *, force: bool = False) -> Deleted:
    """Delete every key of a run and its entry in the run index.

    Refused (RunBusy) while an aggregator holds the run's lease, and while the run is
    running or queued unless ``force``; ``force`` deletes such a run only once its
    aggregator and workers are gone: no lease, and no worker heard from for the run's
    ``worker_timeout_s`` (what the aggregator itself takes for a worker that is gone).
    RunNotFound for an unknown run; a run whose deletion was cut short is finished.
    """
    if not is_valid_run_id(run_id):
        raise RunNotFound(f"no run {run_id!r}: not a valid run id")
    _refuse_if_another_shard_is_led(client, run_id)
    guards = _write_guards(client, run_id)
    verdict, detail, claimed = _claim(client, run_id, force)
    if verdict == "deleting":
        raise RunNotFound(f"no run {run_id!r}: another deletion of it is under way")
    if verdict not in ("claimed", "missing"):
        raise RunBusy(verdict, _refusal(run_id, verdict, detail))
    # What workers check before they write (a head) and what they append to (a stream)
    # go first: a worker frozen until now cannot make the run's keys again.
    count = claimed + sum(client.unlink(key) for key in guards)
    count += _unlink_matching(client, run_key_pattern(run_id))
    if verdict == "missing" and client.zscore(RUNS_INDEX, run_id) is None:
        if not count:
            raise RunNotFound(f"no run {run_id!r} in Redis")
        log.warning("run %s: removed %d keys its writers left after its deletion",
                    run_id, count)
        return Deleted(run_id, count, None)
    client.zrem(RUNS_INDEX, run_id)
    client.delete(deletion_marker(run_id))
    return_freed_memory(client)
    log.info("deleted run %s (%d keys)", run_id, count)
    return Deleted(run_id, count, detail if verdict == "claimed" and detail else None)


def _refuse_if_another_shard_is_led(client: redis.Redis, run_id: str) -> None:
    """RunBusy if an aggregator holds the lease of a shard other than shard 0 (whose lease
    the claim script checks: the others live in other Cluster slots)."""
    with contextlib.suppress(RunNotFound):
        for shard in RunStore(client, run_id).shards()[1:]:
            if client.exists(shard.keys.lease):
                raise RunBusy("led", _refusal(run_id, "led", ""))


def _write_guards(client: redis.Redis, run_id: str) -> list[str]:
    """The head and gradient stream of each shard of the run (none once its configuration
    is gone)."""
    with contextlib.suppress(RunNotFound):
        return [key for shard in RunStore(client, run_id).shards()
                for key in (shard.keys.head, shard.keys.gradients)]
    return []


def _claim(client: redis.Redis, run_id: str, force: bool) -> tuple[str, str, int]:
    """scripts.CLAIM_DELETION's (verdict, detail, keys it deleted)."""
    store = RunStore(client, run_id)
    quiet_since = 0
    # Without a configuration the run is being deleted already: nothing runs it.
    with contextlib.suppress(RunNotFound):
        quiet_since = now_ms() - int(1000 * store.config().worker_timeout_s)
    keys = store.keys
    claim = client.register_script(scripts.CLAIM_DELETION)
    reply: Any = claim(keys=[keys.status, keys.lease, keys.workers, keys.config,
                             deletion_marker(run_id)],
                       args=["1" if force else "0", quiet_since, DELETION_MARKER_MS])
    verdict, detail, deleted = reply
    return verdict.decode(), detail.decode(), int(deleted)


def _refusal(run_id: str, verdict: str, detail: str) -> str:
    stop = f"stop it first (the dashboard, or POST /api/runs/{run_id}/stop)"
    if verdict == "led":
        return (f"run {run_id!r} is held by an aggregator (running, or just ending): "
                f"{stop}, and delete it once it has ended")
    if verdict == "workers":
        return (f"run {run_id!r}: worker {detail!r} was heard from within the run's "
                "worker timeout; it may still write to the run")
    what = "queued for an aggregator" if detail == "created" else detail
    return f"run {run_id!r} is {what}: {stop}"


def _unlink_matching(client: redis.Redis, pattern: str) -> int:
    """UNLINK every key matching ``pattern`` (one command per key: the keys of different
    shards live in different Redis Cluster slots); return how many there were."""
    found = list(client.scan_iter(match=pattern, count=SCAN_BATCH))
    removed = 0
    for start in range(0, len(found), SCAN_BATCH):
        pipe = _untyped(client).pipeline(transaction=False)
        for key in found[start:start + SCAN_BATCH]:
            pipe.unlink(key)
        removed += sum(pipe.execute())
    return removed


# --- how many ended runs are kept ---------------------------------------------------------

@dataclass(frozen=True)
class RetentionPolicy:
    """Which ended runs the API service's sweep deletes; running, queued and created runs
    are never deleted."""

    #: Ended runs kept, the most recently ended first; older ones are deleted. 0: no limit.
    keep_runs: int = 100
    #: Ended runs are deleted this many days after they ended. 0: no limit.
    keep_days: float = 0.0

    def doomed(self, ended: dict[str, int], now: int) -> list[str]:
        """The runs of ``ended`` (run id -> when it ended, ms) to delete, oldest first."""
        newest_first = sorted(ended, key=lambda r: ended[r], reverse=True)
        doomed = set(newest_first[self.keep_runs:]) if self.keep_runs else set()
        if self.keep_days:
            cutoff = now - self.keep_days * DAY_MS
            doomed |= {r for r, at in ended.items() if at < cutoff}
        return sorted(doomed, key=lambda r: ended[r])


@dataclass(frozen=True)
class Swept:
    """What one sweep did."""

    released: list[str]
    deleted: list[str]


def apply_retention(client: redis.Redis, policy: RetentionPolicy,
                    now: int | None = None) -> Swept:
    """One sweep over the run index: free the training state of ended runs that still hold
    it, finish deletions cut short, delete the ended runs ``policy`` does not keep."""
    ended, gone = _ended_runs(client)
    shards = _shard_stores(client, list(ended))
    holding = holds_training_state(client, [store.keys for store in shards])
    released = sorted({store.run_id for store, holds in zip(shards, holding, strict=True)
                       if holds and release_training_state(store)})
    deleted = []
    for run_id in gone + policy.doomed(ended, now_ms() if now is None else now):
        try:
            delete_run(client, run_id)
        except (RunBusy, RunNotFound) as e:  # restarted, or deleted meanwhile
            log.info("retention: run %s not deleted: %s", run_id, e)
            continue
        deleted.append(run_id)
    return Swept(released, deleted)


def _ended_runs(client: redis.Redis) -> tuple[dict[str, int], list[str]]:
    """(ended run id -> when it ended (ms), ids in the index whose run has no status: a
    deletion cut short). A run that does not say when it ended counts from its creation."""
    index: list[tuple[bytes, float]] = _untyped(client).zrange(RUNS_INDEX, 0, -1,
                                                               withscores=True)
    ids = [raw.decode() for raw, _ in index]
    pipe = _untyped(client).pipeline(transaction=False)
    for run_id in ids:
        pipe.hmget(RunKeys(run_id).status, ["state", "ended_ms"])
    ended, gone = {}, []
    for run_id, (_, created), (state, ended_ms) in zip(ids, index, pipe.execute(),
                                                       strict=True):
        if state is None:
            gone.append(run_id)
        elif state.decode() in ENDED:
            ended[run_id] = int(ended_ms) if ended_ms else int(created)
    return ended, gone


def _untyped(client: redis.Redis) -> Any:
    # redis-py types replies as unions that depend on decode_responses; gemq's clients
    # always return bytes (as in RunStore).
    return client
