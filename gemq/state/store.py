"""The Redis side of a run: the commands gemq sends about a run's state go through RunStore
(and, for the lease holder of a shard, through gemq.aggregation.leadership.Leadership).

A few modules talk to Redis themselves, each for a reason of its own, and no other may:

- gemq.state.retention: a run's whole key set, every shard at once (SCAN for its keys,
  deletions under WATCH on the head, MEMORY PURGE): the end of a run's life, not its state;
- gemq.state.placement and gemq.state.connection: the server, not a run (the cluster's slot
  map at run creation; whether a connection is to a cluster);
- gemq.training.shardset: sends RunStore's queued commands (``queue_*``) for every shard in
  one pipeline, the worker's one round trip a step;
- gemq.running (embedded, cluster, local): the private servers they start (INFO, CLUSTER
  setup, CONFIG SET of the bulk length);
- the services (gemq.services): rq's job queue and the health probes' PING.

A RunStore speaks for one shard of a run (gemq/shards.py; a run of one shard has only
shard 0) and for the run-wide state in shard 0's slot: configuration, layout, status, and
the hash tags run creation placed shards under on a Redis Cluster (gemq/state/placement.py),
through which a store of shard k finds the shard's keys.
Parameters are published as immutable snapshots ``params:<version>`` where the version is the
number of updates the shard applied so far; ``head`` names the newest. A reader can therefore
never get a parameter vector with the wrong version: the version is part of the key.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import redis

from gemq.config import RunConfig
from gemq.errors import PublishRefused, RunBusy, RunExists, RunNotFound
from gemq.layout import ParamLayout
from gemq.shards import ShardPlan
from gemq.state import placement, scripts
from gemq.state.keys import (
    AGGREGATOR_GROUP,
    MESSAGE_FIELD,
    RUNS_INDEX,
    SENDER_FIELD,
    RunKeys,
    shard_tag,
)
from gemq.wire.codec import Message


class RunState(StrEnum):
    """A run's lifecycle state, as stored in its status hash."""

    CREATED = "created"
    RUNNING = "running"
    FINISHED = "finished"  # the budget was spent
    STOPPED = "stopped"  # a stop was requested
    FAILED = "failed"  # the aggregation gave up; the status hash says why


ENDED = frozenset({RunState.FINISHED, RunState.STOPPED, RunState.FAILED})
#: Metrics entries kept per run (approximately: trimming is lazy).
METRICS_MAXLEN = 20_000
#: The largest stream entry id: once a stream holds it, no XADD can succeed.
LAST_POSSIBLE_ID = f"{2**64 - 1}-{2**64 - 1}"
#: Workers a listing shows at most (the most recently heard from).
WORKER_LISTING = 200


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Head:
    version: int
    updates: int
    last_id: str
    #: The shard's own final state once its aggregator ended it (finished, stopped, failed).
    state: str | None = None


@dataclass(frozen=True)
class StepView:
    """What a worker needs to know of a shard before each step, read in one round trip
    (``state``: the run's, read with shard 0's view only)."""

    version: int
    pending: int
    state: str | None = None


class RunStore:
    """Typed access to one shard of a run (and the run-wide keys); the connection is passed
    in and owned by the caller.

    ``tag``: the shard's hash tag, if the caller has read it (``shards()`` does); otherwise
    a store of a shard other than 0 reads it from the run's ``shard_tags``."""

    def __init__(self, client: redis.Redis, run_id: str, shard: int = 0,
                 tag: str | None = None) -> None:
        self.client = client
        # redis-py types replies as unions that depend on decode_responses; this store always
        # works with bytes replies, so its internal calls go through an untyped alias.
        self._r: Any = client
        if tag is None and shard:
            tag = self._stored_tag(run_id, shard)
        self.keys = RunKeys(run_id, shard, tag)
        self._fail = client.register_script(scripts.FAIL)
        self._conclude = client.register_script(scripts.CONCLUDE)
        self._claim_evaluation = client.register_script(scripts.CLAIM_EVALUATION)
        self._claim_start = client.register_script(scripts.CLAIM_START)
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._record_evaluation = client.register_script(scripts.RECORD_EVALUATION)

    def _stored_tag(self, run_id: str, shard: int) -> str | None:
        """The tag run creation placed ``shard`` under; None: it kept its default."""
        raw = self._r.hget(RunKeys(run_id).shard_tags, shard)
        return raw.decode() if raw is not None else None

    @property
    def run_id(self) -> str:
        return self.keys.run_id

    @property
    def shard(self) -> int:
        return self.keys.shard

    def of_shard(self, shard: int) -> RunStore:
        """The same run's store for another shard, on the same connection."""
        return self if shard == self.shard else RunStore(self.client, self.run_id, shard)

    def shards(self) -> list[RunStore]:
        """One store per shard of the run, shard 0 first."""
        count = self.config().shards
        placed = self._placed_tags() if count > 1 else {}
        return [self if k == self.shard else
                RunStore(self.client, self.run_id, k, placed.get(k, shard_tag(self.run_id, k)))
                for k in range(count)]

    def _placed_tags(self) -> dict[int, str]:
        raw = self._r.hgetall(self.keys.shard_tags)
        return {int(k): v.decode() for k, v in raw.items()}

    def plan(self) -> ShardPlan:
        return ShardPlan.of(self.layout(), self.config().shards)

    # --- creation and static run data ---------------------------------------------------

    def create(self, config: RunConfig, layout: ParamLayout, params: np.ndarray) -> None:
        """Write a new run: config, layout, each shard's version-0 parameters, empty stream
        and group. Shards 1 and up are written first and the configuration last (with
        shard 0, in its slot, and the shards' placed tags): a run is visible only once it is
        whole."""
        if self._r.exists(self.keys.config):
            raise RunExists(f"run {self.run_id!r} already exists")
        plan = ShardPlan.of(layout, config.shards)
        placed = placement.placed_tags(self.client, self.run_id, plan.count)
        for shard in reversed(plan.shards):
            k = RunKeys(self.run_id, shard.index, placed.get(shard.index))
            pipe = self._r.pipeline(transaction=True)  # one slot: the shard's
            pipe.set(k.params(0), as_f32_bytes(params[shard.slice]))
            pipe.zadd(k.versions, {"0": 0})
            pipe.hset(k.head, mapping={"version": 0, "updates": 0, "last_id": "0-0"})
            pipe.xgroup_create(k.gradients, AGGREGATOR_GROUP, id="0", mkstream=True)
            if shard.index == 0:
                pipe.set(k.config, config.to_json())
                pipe.set(k.layout, layout.to_json())
                pipe.hset(k.status, mapping={"state": RunState.CREATED,
                                             "created_ms": now_ms()})
                if placed:
                    pipe.hset(k.shard_tags, mapping=placed)
            pipe.execute()
        self._r.zadd(RUNS_INDEX, {self.run_id: now_ms()})

    def exists(self) -> bool:
        return bool(self._r.exists(self.keys.config))

    def config(self) -> RunConfig:
        raw = self._r.get(self.keys.config)
        if raw is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return RunConfig.from_json(text(raw))

    def layout(self) -> ParamLayout:
        raw = self._r.get(self.keys.layout)
        if raw is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return ParamLayout.from_json(text(raw))

    # --- parameters -------------------------------------------------------------------

    def head(self) -> Head:
        version, updates, last_id, state = self._r.hmget(
            self.keys.head, ["version", "updates", "last_id", "state"])
        if version is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return Head(int(version), int(updates), last_id.decode(),
                    state.decode() if state is not None else None)

    def snapshot(self, version: int) -> np.ndarray | None:
        """The parameters published at ``version``, or None once they were dropped."""
        raw = self._r.get(self.keys.params(version))
        return None if raw is None else np.frombuffer(raw, dtype="<f4")

    def latest(self, version: int | None = None) -> tuple[int, np.ndarray]:
        """The newest (version, parameters) pair; ``version``: a head the caller just read."""
        while True:
            version = self.head().version if version is None else version
            params = self.snapshot(version)
            if params is not None:
                return version, params
            version = None  # superseded and dropped since the head was read: read it again

    def kept_versions(self) -> list[int]:
        return [int(v) for v in self._r.zrange(self.keys.versions, 0, -1)]

    # --- status -----------------------------------------------------------------------

    def status(self) -> dict[str, str]:
        raw = self._r.hgetall(self.keys.status)
        if not raw:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def state(self) -> RunState:
        return RunState(self.status()["state"])

    def mark_running(self, leader: str) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self.keys.status, mapping={"state": RunState.RUNNING, "leader": leader})
        pipe.hsetnx(self.keys.status, "started_ms", now_ms())
        pipe.execute()

    def set_status(self, **fields: Any) -> None:
        self._r.hset(self.keys.status, mapping=fields)

    def claim_start(self, job_ids: list[str]) -> None:
        """Record the aggregation jobs of a created run that has none, in one atomic step;
        RunNotFound if the run is gone, RunBusy if it was started (or has ended) already."""
        outcome = self._claim_start(keys=[self.keys.status],
                                    args=[job_ids[0], ",".join(job_ids)]).decode()
        if outcome == "missing":
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        if outcome != "ok":
            raise RunBusy(outcome, f"run {self.run_id!r} is {outcome} and was already "
                                   "started")

    def request_stop(self) -> None:
        self._r.hset(self.keys.status, "stop_requested", now_ms())

    def fail(self, error: str) -> bool:
        """Mark the run failed with ``error`` unless it has ended; True if this did it."""
        return bool(self._fail(keys=[self.keys.status], args=[error, now_ms()]))

    def conclude(self) -> RunState | None:
        """Give the run its final state once its shards have theirs (each shard's aggregator
        sets its own, in its own slot): failed as soon as one shard failed, otherwise once
        every shard ended, finished if all did. Idempotent; returns the run's state if it
        has ended."""
        shards = self.shards()
        heads = [s.head() for s in shards]
        failed = next((h for h in heads if h.state == RunState.FAILED), None)
        if failed is None and not all(h.state in ENDED for h in heads):
            return None
        state = (RunState.FAILED if failed else RunState.FINISHED
                 if all(h.state == RunState.FINISHED for h in heads) else RunState.STOPPED)
        error = shards[heads.index(failed)].shard_error() if failed else ""
        self._conclude(keys=[self.keys.status], args=[state, now_ms(), error])
        return self.state()

    def shard_error(self) -> str:
        """Why this shard failed, as its aggregator wrote it into the shard's head."""
        raw = self._r.hget(self.keys.head, "error")
        return raw.decode() if raw is not None else ""

    def counters(self) -> dict[str, int]:
        raw = self._r.hgetall(self.keys.counters)
        return {k.decode(): int(v) for k, v in raw.items()}

    def leader(self) -> str | None:
        """The token of the aggregator holding the shard's lease (host:pid:nonce), or None
        while no aggregator leads it."""
        raw = self._r.get(self.keys.lease)
        return raw.decode() if raw is not None else None

    # --- the worker's side ------------------------------------------------------------

    def step_view(self) -> StepView:
        pipe = self._r.pipeline(transaction=False)
        self.queue_view(pipe)
        return self.view_of(pipe.execute())

    def publish_gradient(self, worker_id: str, message: Message) -> str:
        """XADD one gradient and count it, atomically (so published counts are exact)."""
        pipe = self._r.pipeline(transaction=True)
        self._queue_publish(pipe, worker_id, message)
        replies = pipe.execute(raise_on_error=False)
        _check_published(replies, self.run_id)
        return str(replies[1].decode())

    def publish_and_view(self, worker_id: str, message: Message) -> StepView:
        """``publish_gradient``, then ``step_view`` for the worker's next step, in one
        round trip (a worker reads the view right after publishing anyway)."""
        pipe = self._r.pipeline(transaction=True)
        self.queue_publish_and_view(pipe, worker_id, message)
        return self.published_view(pipe.execute(raise_on_error=False))

    def queue_publish_and_view(self, pipe: Any, worker_id: str, message: Message) -> None:
        """Queue ``publish_and_view`` on a caller's transaction pipeline (several shards'
        in one, on one Redis)."""
        self._queue_publish(pipe, worker_id, message)
        self.queue_view(pipe)

    def published_view(self, replies: list[Any]) -> StepView:
        """The view ``queue_publish_and_view`` brought back (its replies, in order)."""
        _check_published(replies, self.run_id)
        return self.view_of(replies[3:])

    @property
    def view_length(self) -> int:
        """Replies ``queue_view`` adds to a pipeline (the run's state: shard 0's only)."""
        return 3 if self.shard == 0 else 2

    @property
    def publish_length(self) -> int:
        """Replies ``queue_publish_and_view`` adds to a pipeline."""
        return 3 + self.view_length

    def _queue_publish(self, pipe: Any, worker_id: str, message: Message) -> None:
        """Three commands (see scripts.MARK): the XADD is counted only if it took. The
        scripts go by their text (EVAL): inside a MULTI an unknown SHA would fail after the
        XADD had run, leaving it uncounted. They are sent by command name: a cluster
        pipeline's ``eval`` method is something else."""
        k = self.keys
        worker = k.worker(worker_id)
        pipe.execute_command("EVAL", scripts.MARK, 2, k.gradients, worker)
        pipe.xadd(k.gradients, {SENDER_FIELD: worker_id, MESSAGE_FIELD: message},
                  nomkstream=True)
        pipe.execute_command("EVAL", scripts.COUNTED, 4, k.gradients, worker, k.counters,
                             k.workers, worker_id, now_ms())

    def queue_view(self, pipe: Any) -> None:
        pipe.hget(self.keys.head, "version")
        pipe.xlen(self.keys.gradients)
        if self.shard == 0:  # the run's status lives in shard 0's slot
            pipe.hget(self.keys.status, "state")

    def queue_snapshot(self, pipe: Any, version: int) -> None:
        """Queue ``snapshot``'s read (its reply: the raw parameters, or None once dropped)."""
        pipe.get(self.keys.params(version))

    def view_of(self, replies: list[Any]) -> StepView:
        version, pending, *state = replies
        if version is None or (state and state[0] is None):
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return StepView(int(version), int(pending), state[0].decode() if state else None)

    def heartbeat(self, worker_id: str) -> None:
        self._heartbeat(keys=[self.keys.head, self.keys.worker(worker_id), self.keys.workers],
                        args=[worker_id, now_ms()])

    def worker_states(self, limit: int = WORKER_LISTING) -> dict[str, dict[str, str]]:
        """The ``limit`` workers heard from most recently, by id."""
        ids = sorted(w.decode() for w in self._r.zrevrange(self.keys.workers, 0, limit - 1))
        pipe = self._r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.keys.worker(worker_id))
        return {worker_id: {k.decode(): v.decode() for k, v in raw.items()}
                for worker_id, raw in zip(ids, pipe.execute(), strict=True)}

    def worker_count(self, since_ms: int = 0) -> int:
        """Workers registered with the run (heard from since ``since_ms``, if given)."""
        return int(self._r.zcount(self.keys.workers, since_ms, "+inf"))

    def claim_evaluation(self, index: int) -> bool:
        """True for the first worker to claim held-out evaluation ``index``."""
        return bool(self._claim_evaluation(keys=[self.keys.evaluation_claim, self.keys.head],
                                           args=[index]))

    def record_evaluation(self, updates: int, loss: float, accuracy: float | None) -> None:
        """Leave a held-out evaluation of the parameters at ``updates`` for the next commit
        to put into its metrics entry."""
        fields = {"eval_updates": str(updates), "test_loss": f"{loss:.6g}"}
        if accuracy is not None:
            fields["test_accuracy"] = f"{accuracy:.6g}"
        self._record_evaluation(keys=[self.keys.head, self.keys.evaluations],
                                args=[json.dumps([x for pair in fields.items() for x in pair])])

    def workers_since(self, since_ms: int) -> set[str]:
        """The ids of the workers heard from since ``since_ms``."""
        return {w.decode() for w in self._r.zrangebyscore(self.keys.workers, since_ms, "+inf")}

    def registered(self, worker_ids: list[str]) -> list[bool]:
        """Whether each worker has published to this run (in one round trip)."""
        if not worker_ids:
            return []
        scores = self._r.zmscore(self.keys.workers, worker_ids)
        return [score is not None for score in scores]

    def checkpointed_moments(self) -> tuple[int, dict[str, np.ndarray]]:
        """The GEM moments of the last checkpoint, by worker id, and its version (-1: none)."""
        index = {w.decode(): int(v) for w, v in self._r.hgetall(self.keys.moments).items()}
        ids = sorted(index)
        values = self._r.mget([self.keys.moment(w) for w in ids]) if ids else []
        moments = {w: np.frombuffer(v, "<f4") for w, v in zip(ids, values, strict=True)
                   if v is not None}
        return max(index.values(), default=-1), moments

    def unconsumed(self, limit: int = 100_000) -> int:
        """Entries in the stream no commit has acknowledged: pending (read, not yet
        committed) or never read at all."""
        groups = self._r.xinfo_groups(self.keys.gradients)
        group = next((g for g in groups if g["name"] == AGGREGATOR_GROUP.encode()), None)
        if group is None:
            return 0
        delivered = group["last-delivered-id"].decode()
        if delivered == LAST_POSSIBLE_ID:
            return int(group["pending"])  # nothing can come after it
        unread = self._r.xrange(self.keys.gradients, min=f"({delivered}", count=limit)
        return int(group["pending"]) + len(unread)

    def metrics_since(self, after_id: str = "0-0",
                      count: int = 1000) -> list[tuple[str, dict[str, str]]]:
        rows = self._r.xrange(self.keys.metrics, min=f"({after_id}", count=count)
        return _decoded_rows(rows)

    def latest_metrics(self, count: int) -> list[tuple[str, dict[str, str]]]:
        """The newest ``count`` metrics rows, oldest first."""
        return _decoded_rows(reversed(self._r.xrevrange(self.keys.metrics, count=count)))


def run_ids(client: redis.Redis, limit: int = 100, offset: int = 0) -> list[str]:
    """Ids of the runs in the index, newest first: ``limit`` of them after the first
    ``offset``."""
    raw: Any = client.zrevrange(RUNS_INDEX, offset, offset + limit - 1)
    return [r.decode() for r in raw]


def run_count(client: redis.Redis) -> int:
    """How many runs the index holds."""
    return int(client.zcard(RUNS_INDEX))


def _decoded_rows(rows: Any) -> list[tuple[str, dict[str, str]]]:
    return [(i.decode(), {k.decode(): text(v) for k, v in f.items()}) for i, f in rows]


def text(raw: Message) -> str:
    """A stored value as text. Values of a megabyte or more (a layout of tens of thousands
    of tensors, their per-tensor pi) arrive as memoryviews (gemq/state/bulkreads.py)."""
    return bytes(raw).decode()


def as_f32_bytes(params: np.ndarray) -> bytes:
    return np.ascontiguousarray(params, dtype="<f4").tobytes()


def f32_view(params: np.ndarray) -> memoryview:
    """The little-endian float32 bytes of ``params`` as a view: sent without a copy."""
    array = np.ascontiguousarray(params, dtype="<f4")
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def _check_published(replies: list[Any], run_id: str) -> None:
    """Raise what kept a publication's MULTI (MARK, XADD, COUNTED) from adding its entry."""
    for reply in replies[:3]:
        if isinstance(reply, redis.ResponseError):
            raise PublishRefused(f"Redis refused the gradient: {reply}") from reply
        if isinstance(reply, Exception):
            raise reply
    if replies[1] is None:  # NOMKSTREAM: the stream, and so the run, is gone
        raise RunNotFound(f"no run {run_id!r} in Redis")
    if replies[2] != 1:
        raise PublishRefused("Redis did not add the gradient to the stream")
