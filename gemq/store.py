"""The Redis side of a run: every command gemq sends goes through RunStore.

Parameters are published as immutable snapshots ``params:<version>`` where the version is the
number of updates applied so far; ``head`` names the newest. A reader can therefore never get
a parameter vector with the wrong version: the version is part of the key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np
import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from gemq import scripts
from gemq.config import RunConfig
from gemq.errors import FencedError, PublishRefused, RunExists, RunNotFound
from gemq.keys import AGGREGATOR_CONSUMER, AGGREGATOR_GROUP, RUNS_INDEX, RunKeys
from gemq.layout import ParamLayout


class RunState(StrEnum):
    """A run's lifecycle state, as stored in its status hash."""

    CREATED = "created"
    RUNNING = "running"
    FINISHED = "finished"  # the budget was spent
    STOPPED = "stopped"  # a stop was requested
    FAILED = "failed"  # the aggregation gave up; the status hash says why


ENDED = frozenset({RunState.FINISHED, RunState.STOPPED, RunState.FAILED})
Fields = dict[bytes, bytes]
#: Metrics entries kept per run (approximately: trimming is lazy).
METRICS_MAXLEN = 20_000
#: The largest stream entry id: once a stream holds it, no XADD can succeed.
LAST_POSSIBLE_ID = f"{2**64 - 1}-{2**64 - 1}"
#: Workers a listing shows at most (the most recently heard from).
WORKER_LISTING = 200
#: A staged parameter vector whose commit script never ran (the leader died between its SET
#: and the script, or was fenced) is deleted by Redis after this long.
STAGING_TTL_MS = 60_000


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Head:
    version: int
    updates: int
    last_id: str


@dataclass
class CommitPlan:
    """Everything one aggregator batch writes, in one atomic step."""

    version: int
    updates: int
    #: The head's last applied id before this batch, and after it.
    prev_id: str
    last_id: str
    ack: list[str]
    publish: bool = True
    drop: list[int] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    #: worker id -> (fields to set, fields to increment)
    workers: dict[str, tuple[dict[str, Any], dict[str, int]]] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    #: GEM moments checkpointed with this commit (by worker id), and checkpoints dropped.
    checkpoint: dict[str, np.ndarray] = field(default_factory=dict)
    forget: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ReadRequest:
    """How the aggregator's next read is made (see RunStore.fenced_read)."""

    count: int
    pending_after: str = "0"
    block_ms: int = 0


@dataclass(frozen=True)
class BatchRead:
    """What one fenced read returned."""

    stop_requested: bool
    #: The run was failed meanwhile (by a worker that cannot publish): stop leading.
    failed: bool
    #: (stream id, fields or None): unacknowledged entries first, then new ones.
    entries: list[tuple[str, Fields | None]]
    #: How many of the entries came from the pending list.
    pending: int


@dataclass(frozen=True)
class StepView:
    """What a worker needs to know before each step, read in one round trip."""

    version: int
    pending: int
    state: str


class RunStore:
    """Typed access to one run's keys; the connection is passed in and owned by the caller."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.client = client
        # redis-py types replies as unions that depend on decode_responses; this store always
        # works with bytes replies, so its internal calls go through an untyped alias.
        self._r: Any = client
        self.keys = RunKeys(run_id)
        self._renew = client.register_script(scripts.RENEW)
        self._commit = client.register_script(scripts.COMMIT)
        self._release = client.register_script(scripts.RELEASE)
        self._fail = client.register_script(scripts.FAIL)

    @property
    def run_id(self) -> str:
        return self.keys.run_id

    # --- creation and static run data ---------------------------------------------------

    def create(self, config: RunConfig, layout: ParamLayout, params: np.ndarray) -> None:
        """Write a new run: config, layout, version-0 parameters, empty stream and group."""
        k = self.keys
        if self._r.exists(k.config):
            raise RunExists(f"run {self.run_id!r} already exists")
        pipe = self._r.pipeline(transaction=True)
        pipe.set(k.config, config.to_json())
        pipe.set(k.layout, layout.to_json())
        pipe.set(k.params(0), as_f32_bytes(params))
        pipe.zadd(k.versions, {"0": 0})
        pipe.hset(k.head, mapping={"version": 0, "updates": 0, "last_id": "0-0"})
        pipe.hset(k.status, mapping={"state": RunState.CREATED, "created_ms": now_ms()})
        pipe.xgroup_create(k.gradients, AGGREGATOR_GROUP, id="0", mkstream=True)
        pipe.zadd(RUNS_INDEX, {self.run_id: now_ms()})
        pipe.execute()

    def exists(self) -> bool:
        return bool(self._r.exists(self.keys.config))

    def config(self) -> RunConfig:
        raw = self._r.get(self.keys.config)
        if raw is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return RunConfig.from_json(raw)

    def layout(self) -> ParamLayout:
        raw = self._r.get(self.keys.layout)
        if raw is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return ParamLayout.from_json(raw)

    # --- parameters -------------------------------------------------------------------

    def head(self) -> Head:
        version, updates, last_id = self._r.hmget(
            self.keys.head, ["version", "updates", "last_id"])
        if version is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return Head(int(version), int(updates), last_id.decode())

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

    def request_stop(self) -> None:
        self._r.hset(self.keys.status, "stop_requested", now_ms())

    def fail(self, error: str) -> bool:
        """Mark the run failed with ``error`` unless it has ended; True if this did it."""
        return bool(self._fail(keys=[self.keys.status], args=[error, now_ms()]))

    def counters(self) -> dict[str, int]:
        raw = self._r.hgetall(self.keys.counters)
        return {k.decode(): int(v) for k, v in raw.items()}

    # --- the worker's side ------------------------------------------------------------

    def step_view(self) -> StepView:
        pipe = self._r.pipeline(transaction=False)
        self._queue_view(pipe)
        return self._view_of(pipe.execute())

    def publish_gradient(self, worker_id: str, message: bytes) -> str:
        """XADD one gradient and count it, atomically (so published counts are exact)."""
        pipe = self._r.pipeline(transaction=True)
        self._queue_publish(pipe, worker_id, message)
        replies = pipe.execute(raise_on_error=False)
        _check_published(replies)
        return str(replies[1].decode())

    def publish_and_view(self, worker_id: str, message: bytes) -> StepView:
        """``publish_gradient``, then ``step_view`` for the worker's next step, in one
        round trip (a worker reads the view right after publishing anyway)."""
        pipe = self._r.pipeline(transaction=True)
        self._queue_publish(pipe, worker_id, message)
        self._queue_view(pipe)
        replies = pipe.execute(raise_on_error=False)
        _check_published(replies)
        return self._view_of(replies[-3:])

    def _queue_publish(self, pipe: Any, worker_id: str, message: bytes) -> None:
        """Three commands (see scripts.MARK): the XADD is counted only if it took. The
        scripts go by their text (EVAL): inside a MULTI an unknown SHA would fail after the
        XADD had run, leaving it uncounted."""
        k = self.keys
        worker = k.worker(worker_id)
        pipe.eval(scripts.MARK, 2, k.gradients, worker)
        pipe.xadd(k.gradients, {"w": worker_id, "m": message})
        pipe.eval(scripts.COUNTED, 4, k.gradients, worker, k.counters, k.workers, worker_id,
                  now_ms())

    def _queue_view(self, pipe: Any) -> None:
        pipe.hget(self.keys.head, "version")
        pipe.xlen(self.keys.gradients)
        pipe.hget(self.keys.status, "state")

    def _view_of(self, replies: list[Any]) -> StepView:
        version, pending, state = replies
        if version is None or state is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return StepView(int(version), int(pending), state.decode())

    def heartbeat(self, worker_id: str) -> None:
        now = now_ms()
        pipe = self._r.pipeline(transaction=False)
        pipe.hset(self.keys.worker(worker_id), "heartbeat_ms", now)
        pipe.zadd(self.keys.workers, {worker_id: now})
        pipe.execute()

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

    def registered(self, worker_ids: list[str]) -> list[bool]:
        """Whether each worker has published to this run (in one round trip)."""
        if not worker_ids:
            return []
        scores = self._r.zmscore(self.keys.workers, worker_ids)
        return [score is not None for score in scores]

    # --- the aggregator's side ----------------------------------------------------------

    def acquire_lease(self, token: str, lease_ms: int) -> bool:
        return bool(self._r.set(self.keys.lease, token, nx=True, px=lease_ms))

    def release_lease(self, token: str) -> None:
        self._release(keys=[self.keys.lease], args=[token])

    def fenced_read(self, token: str, lease_ms: int, count: int, *,
                    pending_after: str = "0", block_ms: int = 0) -> BatchRead:
        """Renew the lease and read a batch, in one round trip.

        Entries delivered earlier but never acknowledged (a previous leader's batch, one
        whose reply was lost) with ids above ``pending_after`` come before new ones. With
        ``block_ms``, Redis holds the reply up to that long while no new entry exists, so an
        idle leader waits without another round trip. Fields are None for an entry deleted
        while pending.
        """
        request = ReadRequest(count, pending_after, block_ms)
        # A read whose script Redis lacked still moved entries into the pending list; the
        # second attempt reads them from there.
        replies = self._with_scripts(lambda pipe: self._queue_read(pipe, token, lease_ms,
                                                                   request))
        return self._read_result(replies, count)

    def commit(self, token: str, lease_ms: int, plan: CommitPlan, params: np.ndarray) -> bool:
        """Apply ``plan`` atomically; False if the head had already moved past prev_id."""
        replies = self._with_scripts(lambda pipe: self._queue_commit(pipe, token, lease_ms,
                                                                     plan, params))
        return self._commit_result(replies[-1])

    def checkpointed_moments(self) -> tuple[int, dict[str, np.ndarray]]:
        """The GEM moments of the last checkpoint, by worker id, and its version (-1: none)."""
        index = {w.decode(): int(v) for w, v in self._r.hgetall(self.keys.moments).items()}
        ids = sorted(index)
        values = self._r.mget([self.keys.moment(w) for w in ids]) if ids else []
        moments = {w: np.frombuffer(v, "<f4") for w, v in zip(ids, values, strict=True)
                   if v is not None}
        return max(index.values(), default=-1), moments

    def commit_then_read(self, token: str, lease_ms: int, plan: CommitPlan,
                         params: np.ndarray, request: ReadRequest) -> tuple[bool, BatchRead]:
        """``commit``, then ``fenced_read``, in one round trip.

        The read runs whatever the commit's outcome; if the commit was fenced, what the read
        took stays in the pending list for the real leader.
        """
        def both(pipe: Any) -> None:
            self._queue_commit(pipe, token, lease_ms, plan, params)
            self._queue_read(pipe, token, lease_ms, request)

        replies = self._with_scripts(both)
        committed = self._commit_result(replies[-4])
        return committed, self._read_result(replies[-3:], request.count)

    def _with_scripts(self, build: Callable[[Any], None]) -> list[Any]:
        """Run a pipeline that calls scripts by SHA; load them if Redis lacks them.

        redis-py's own scripts in a pipeline cost an extra round trip (SCRIPT EXISTS) per
        execution; here the scripts are loaded once, and again only after Redis says
        NOSCRIPT (it restarted, or its script cache was flushed). Every reply comes back,
        errors included, for the caller to judge.
        """
        for attempt in range(2):
            pipe = self._r.pipeline(transaction=False)
            build(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                for script in (self._renew, self._commit):
                    self._r.script_load(script.script)
                continue
            break
        return replies

    def _queue_read(self, pipe: Any, token: str, lease_ms: int, request: ReadRequest) -> None:
        k = self.keys
        _call_script(pipe, self._renew, [k.lease, k.status], [token, lease_ms])
        pipe.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER,
                        {k.gradients: request.pending_after}, count=request.count)
        pipe.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER, {k.gradients: ">"},
                        count=request.count, block=request.block_ms or None)

    def _read_result(self, replies: list[Any], count: int) -> BatchRead:
        status, pending, new = replies
        for reply in (status, pending, new):
            if isinstance(reply, redis.ResponseError) and str(reply).startswith("NOGROUP"):
                raise RunNotFound(f"run {self.run_id!r}: its gradient stream is gone")
            if isinstance(reply, Exception):
                raise _fenced_or(reply) if isinstance(reply, redis.ResponseError) else reply
        stop, failed = status[0] is not None, status[1] == RunState.FAILED.encode()
        pending_entries = _entries(pending)
        if len(pending_entries) >= count:
            # More may be pending than one read returns. The new entries are in the pending
            # list now, after those: taken here, they would move the commit's trim past
            # pending entries not applied yet. They come back through the pending reads.
            return BatchRead(stop, failed, pending_entries, len(pending_entries))
        return BatchRead(stop, failed, pending_entries + _entries(new), len(pending_entries))

    def _queue_commit(self, pipe: Any, token: str, lease_ms: int, plan: CommitPlan,
                      params: np.ndarray) -> None:
        """Two commands: SET of the staging key (or a no-op), then the commit script.

        The parameters travel in a plain SET of a staging key, which the script renames
        into place or deletes: passed to the script as an argument, Redis would copy them
        into a Lua string, hashing every byte (Redis' Lua interns strings with a full hash),
        and out again. No MULTI is needed around the
        two: the script is the atomic step, and a staging key whose script never ran
        expires by itself.
        """
        k = self.keys
        worker_ids = list(plan.workers)
        staging = k.staging(token)
        keys = [k.lease, k.head, k.versions, k.gradients, k.metrics, k.counters, k.workers,
                k.status, k.params(plan.version), staging, k.moments]
        keys += [k.params(v) for v in plan.drop] + [k.worker(w) for w in worker_ids]
        for worker_id, moment in plan.checkpoint.items():
            keys += [k.staged_moment(token, worker_id), k.moment(worker_id)]
            pipe.set(k.staged_moment(token, worker_id), f32_view(moment), px=STAGING_TTL_MS)
        keys += [k.moment(w) for w in plan.forget]
        encoded = msgpack.packb({
            "version": str(plan.version), "updates": str(plan.updates),
            "prev_id": plan.prev_id, "last_id": plan.last_id, "group": AGGREGATOR_GROUP,
            "ack": plan.ack,
            "publish": plan.publish, "n_drop": len(plan.drop),
            "drop": [str(v) for v in plan.drop],
            "metrics": _flatten(plan.metrics), "metrics_maxlen": str(METRICS_MAXLEN),
            "counters": plan.counters, "status": _flatten(plan.status),
            "workers": [{"id": w, "set": _flatten(plan.workers[w][0]),
                         "incr": plan.workers[w][1]} for w in worker_ids],
            "checkpoint": list(plan.checkpoint), "forget": plan.forget,
        })
        if plan.publish:
            pipe.set(staging, f32_view(params), px=STAGING_TTL_MS)
        else:
            pipe.exists(staging)  # keeps the reply count fixed: the script's is second
        _call_script(pipe, self._commit, keys, [token, lease_ms, encoded])

    @staticmethod
    def _commit_result(reply: Any) -> bool:
        if isinstance(reply, redis.ResponseError):
            raise _fenced_or(reply)
        if isinstance(reply, Exception):
            raise reply
        return bool(reply)

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


def run_ids(client: redis.Redis, limit: int = 100) -> list[str]:
    """Ids of the runs in the index, newest first."""
    raw: Any = client.zrevrange(RUNS_INDEX, 0, limit - 1)
    return [r.decode() for r in raw]


def _decoded_rows(rows: Any) -> list[tuple[str, dict[str, str]]]:
    return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in rows]


def as_f32_bytes(params: np.ndarray) -> bytes:
    return np.ascontiguousarray(params, dtype="<f4").tobytes()


def f32_view(params: np.ndarray) -> memoryview:
    """The little-endian float32 bytes of ``params`` as a view: sent without a copy."""
    array = np.ascontiguousarray(params, dtype="<f4")
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def _call_script(pipe: Any, script: Script, keys: list[str], args: list[Any]) -> None:
    pipe.evalsha(script.sha, len(keys), *keys, *args)


def _flatten(mapping: dict[str, Any]) -> list[str]:
    return [str(x) for pair in mapping.items() for x in pair]


def _entries(reply: Any) -> list[tuple[str, Fields | None]]:
    """The entries of an XREADGROUP reply over one stream."""
    if not reply:
        return []
    (_stream, rows), = reply
    return [(entry_id.decode(), fields or None) for entry_id, fields in rows]


def _check_published(replies: list[Any]) -> None:
    """Raise what kept a publication's MULTI (MARK, XADD, COUNTED) from adding its entry."""
    for reply in replies[:3]:
        if isinstance(reply, redis.ResponseError):
            raise PublishRefused(f"Redis refused the gradient: {reply}") from reply
        if isinstance(reply, Exception):
            raise reply
    if replies[2] != 1:
        raise PublishRefused("Redis did not add the gradient to the stream")


def _fenced_or(error: Exception) -> Exception:
    return FencedError(str(error)) if str(error).startswith("FENCED") else error
