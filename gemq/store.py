"""The Redis side of a run: every command gemq sends goes through RunStore.

Parameters are published as immutable snapshots ``params:<version>`` where the version is the
number of updates applied so far; ``head`` names the newest. A reader can therefore never get
a parameter vector with the wrong version: the version is part of the key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import redis

from gemq import scripts
from gemq.config import RunConfig
from gemq.errors import FencedError, RunNotFound
from gemq.keys import AGGREGATOR_CONSUMER, AGGREGATOR_GROUP, RUNS_INDEX, RunKeys
from gemq.layout import ParamLayout

#: Run lifecycle states, as stored in the status hash.
CREATED, RUNNING, FINISHED, STOPPED, FAILED = (
    "created", "running", "finished", "stopped", "failed")
ENDED = (FINISHED, STOPPED, FAILED)
Fields = dict[bytes, bytes]
#: Metrics entries kept per run (approximately: trimming is lazy).
METRICS_MAXLEN = 20_000


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


@dataclass(frozen=True)
class WorkerView:
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

    @property
    def run_id(self) -> str:
        return self.keys.run_id

    # --- creation and static run data ---------------------------------------------------

    def create(self, config: RunConfig, layout: ParamLayout, params: np.ndarray) -> None:
        """Write a new run: config, layout, version-0 parameters, empty stream and group."""
        k = self.keys
        if self._r.exists(k.config):
            raise FileExistsError(f"run {self.run_id!r} already exists")
        pipe = self._r.pipeline(transaction=True)
        pipe.set(k.config, config.to_json())
        pipe.set(k.layout, layout.to_json())
        pipe.set(k.params(0), as_f32_bytes(params))
        pipe.zadd(k.versions, {"0": 0})
        pipe.hset(k.head, mapping={"version": 0, "updates": 0, "last_id": "0-0"})
        pipe.hset(k.status, mapping={"state": CREATED, "created_ms": now_ms()})
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

    def state(self) -> str:
        return self.status()["state"]

    def mark_running(self, leader: str) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self.keys.status, mapping={"state": RUNNING, "leader": leader})
        pipe.hsetnx(self.keys.status, "started_ms", now_ms())
        pipe.execute()

    def set_status(self, **fields: Any) -> None:
        self._r.hset(self.keys.status, mapping=fields)

    def request_stop(self) -> None:
        self._r.hset(self.keys.status, "stop_requested", now_ms())

    def counters(self) -> dict[str, int]:
        raw = self._r.hgetall(self.keys.counters)
        return {k.decode(): int(v) for k, v in raw.items()}

    # --- the worker's side ------------------------------------------------------------

    def worker_view(self) -> WorkerView:
        pipe = self._r.pipeline(transaction=False)
        pipe.hget(self.keys.head, "version")
        pipe.xlen(self.keys.gradients)
        pipe.hget(self.keys.status, "state")
        version, pending, state = pipe.execute()
        if version is None or state is None:
            raise RunNotFound(f"no run {self.run_id!r} in Redis")
        return WorkerView(int(version), int(pending), state.decode())

    def publish_gradient(self, worker_id: str, message: bytes) -> str:
        """XADD one gradient and count it, atomically (so published counts are exact)."""
        k = self.keys
        pipe = self._r.pipeline(transaction=True)
        pipe.xadd(k.gradients, {"w": worker_id, "m": message})
        pipe.hincrby(k.counters, "published", 1)
        pipe.hincrby(k.worker(worker_id), "steps", 1)
        pipe.hset(k.worker(worker_id), "heartbeat_ms", now_ms())
        pipe.sadd(k.workers, worker_id)
        entry_id = pipe.execute()[0]
        return str(entry_id.decode())

    def heartbeat(self, worker_id: str) -> None:
        self._r.hset(self.keys.worker(worker_id), "heartbeat_ms", now_ms())

    def worker_states(self) -> dict[str, dict[str, str]]:
        ids = sorted(w.decode() for w in self._r.smembers(self.keys.workers))
        pipe = self._r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.keys.worker(worker_id))
        return {worker_id: {k.decode(): v.decode() for k, v in raw.items()}
                for worker_id, raw in zip(ids, pipe.execute(), strict=True)}

    # --- the aggregator's side ----------------------------------------------------------

    def acquire_lease(self, token: str, lease_ms: int) -> bool:
        return bool(self._r.set(self.keys.lease, token, nx=True, px=lease_ms))

    def release_lease(self, token: str) -> None:
        self._release(keys=[self.keys.lease], args=[token])

    def fenced_read(self, token: str, lease_ms: int,
                    count: int) -> tuple[bool, list[tuple[str, Fields | None]]]:
        """Renew the lease and read a batch, in one round trip.

        Entries delivered earlier but never acknowledged (a previous leader's batch, or one
        whose reply was lost) come before new ones. Returns (stop requested, [(id, fields)]);
        fields are None for an entry deleted while pending.
        """
        k = self.keys
        pipe = self._r.pipeline(transaction=False)
        self._renew(keys=[k.lease, k.status], args=[token, lease_ms], client=pipe)
        for start in ("0", ">"):
            pipe.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER, {k.gradients: start},
                            count=count)
        stop, pending, new = pipe.execute(raise_on_error=False)
        for reply in (stop, pending, new):
            if isinstance(reply, redis.ResponseError) and str(reply).startswith("NOGROUP"):
                raise RunNotFound(f"run {self.run_id!r}: its gradient stream is gone")
            if isinstance(reply, Exception):
                raise _fenced_or(reply) if isinstance(reply, redis.ResponseError) else reply
        return stop is not None, _entries(pending) + _entries(new)

    def wait_for_gradients(self, after_id: str, timeout_ms: int) -> None:
        """Block until the stream has an entry newer than ``after_id`` (or the timeout)."""
        self._r.xread({self.keys.gradients: after_id}, count=1, block=timeout_ms)

    def commit(self, token: str, lease_ms: int, plan: CommitPlan, params: np.ndarray) -> bool:
        """Apply ``plan`` atomically; False if the head had already moved past prev_id."""
        k = self.keys
        worker_ids = list(plan.workers)
        keys = [k.lease, k.head, k.versions, k.gradients, k.metrics, k.counters, k.workers,
                k.status, k.params(plan.version)]
        keys += [k.params(v) for v in plan.drop] + [k.worker(w) for w in worker_ids]
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
        })
        payload = as_f32_bytes(params) if plan.publish else b""
        try:
            return bool(self._commit(keys=keys, args=[token, lease_ms, payload, encoded]))
        except redis.ResponseError as e:
            raise _fenced_or(e) from e

    def unconsumed(self, after_id: str, limit: int = 100_000) -> int:
        """Entries in the stream newer than ``after_id``: published but not yet read."""
        return len(self._r.xrange(self.keys.gradients, min=f"({after_id}", count=limit))

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


def _flatten(mapping: dict[str, Any]) -> list[str]:
    return [str(x) for pair in mapping.items() for x in pair]


def _entries(reply: Any) -> list[tuple[str, Fields | None]]:
    """The entries of an XREADGROUP reply over one stream."""
    if not reply:
        return []
    (_stream, rows), = reply
    return [(entry_id.decode(), fields or None) for entry_id, fields in rows]


def _fenced_or(error: Exception) -> Exception:
    return FencedError(str(error)) if str(error).startswith("FENCED") else error
