"""The lease holder's side of a shard in Redis: the lease, fenced reads, atomic commits.

Only the aggregator holding a shard's lease reads its gradient stream and commits to it. A
commit is one Lua script (gemq/scripts.py: COMMIT) that first checks the lease is still
the caller's, then that the head is the one the window was computed from: a deposed leader
writes nothing. Reads need no fence: a deposed leader's read only moves entries into the
pending list, which the leader reads again at the start of every window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from gemq import scripts
from gemq.errors import FencedError, RunNotFound
from gemq.keys import AGGREGATOR_CONSUMER, AGGREGATOR_GROUP
from gemq.store import METRICS_MAXLEN, RunState, RunStore, f32_view

Fields = dict[bytes, bytes]
#: A staged parameter vector whose commit script never ran (the leader died between its SET
#: and the script, or was fenced) is deleted by Redis after this long.
STAGING_TTL_MS = 60_000


@dataclass
class CommitPlan:
    """Everything one aggregator window writes, in one atomic step."""

    version: int
    updates: int
    #: The head's last applied id before this window, and after it.
    prev_id: str
    last_id: str
    ack: list[str]
    publish: bool = True
    drop: list[int] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    #: worker id -> (fields to set, fields to increment)
    workers: dict[str, tuple[dict[str, Any], dict[str, int]]] = field(default_factory=dict)
    #: The shard's final state, set in its head with this commit (state, ended_ms, error).
    final: dict[str, Any] = field(default_factory=dict)
    #: GEM moments checkpointed with this commit (by worker id), and checkpoints dropped.
    checkpoint: dict[str, np.ndarray] = field(default_factory=dict)
    forget: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ReadRequest:
    """How the aggregator's next read is made (see Leadership.read)."""

    count: int
    pending_after: str = "0"
    block_ms: int = 0


@dataclass(frozen=True)
class BatchRead:
    """What one fenced read returned."""

    stop_requested: bool
    #: The run was failed meanwhile (by a worker that cannot publish, or another shard's
    #: aggregator): stop leading.
    failed: bool
    #: (stream id, fields or None): unacknowledged entries first, then new ones.
    entries: list[tuple[str, Fields | None]]
    #: How many of the entries came from the pending list.
    pending: int


class Leadership:
    """The commands of the aggregator that holds (or wants) ``token``'s lease on a shard."""

    def __init__(self, store: RunStore, token: str, lease_ms: int) -> None:
        self.store, self.token, self.lease_ms = store, token, lease_ms
        self.keys = store.keys
        self._r: Any = store.client
        self._renew = store.client.register_script(scripts.RENEW)
        self._commit = store.client.register_script(scripts.COMMIT)
        self._release = store.client.register_script(scripts.RELEASE)

    def acquire(self) -> bool:
        return bool(self._r.set(self.keys.lease, self.token, nx=True, px=self.lease_ms))

    def release(self) -> None:
        self._release(keys=[self.keys.lease], args=[self.token])

    def read(self, count: int, *, pending_after: str = "0", block_ms: int = 0) -> BatchRead:
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
        replies = self._with_scripts(lambda pipe: self._queue_read(pipe, request))
        return self._read_result(replies, count)

    def commit(self, plan: CommitPlan, params: np.ndarray) -> bool:
        """Apply ``plan`` atomically; False if the head had already moved past prev_id."""
        replies = self._with_scripts(lambda pipe: self._queue_commit(pipe, plan, params))
        return _commit_result(replies[-1])

    def commit_then_read(self, plan: CommitPlan, params: np.ndarray,
                         request: ReadRequest) -> tuple[bool, BatchRead]:
        """``commit``, then ``read``, in one round trip.

        The read runs whatever the commit's outcome; if the commit was fenced, what the read
        took stays in the pending list for the real leader.
        """
        def both(pipe: Any) -> None:
            self._queue_commit(pipe, plan, params)
            self._queue_read(pipe, request)

        replies = self._with_scripts(both)
        committed = _commit_result(replies[-READ_REPLIES - 1])
        return committed, self._read_result(replies[-READ_REPLIES:], request.count)

    def _with_scripts(self, build: Callable[[Any], None]) -> list[Any]:
        """Run a pipeline that calls scripts by SHA; load them if Redis lacks them.

        redis-py's own scripts in a pipeline cost an extra round trip (SCRIPT EXISTS) per
        execution; here the scripts are loaded once, and again only after Redis says
        NOSCRIPT (it restarted, or its script cache was flushed). Every reply comes back,
        errors included, for the caller to judge.
        """
        for attempt in range(3):
            pipe = self._r.pipeline(transaction=False)
            build(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            if attempt < 2 and any(isinstance(r, NoScriptError) for r in replies):
                for script in (self._renew, self._commit):
                    self._r.script_load(script.script)
                continue
            break
        return replies

    def _queue_read(self, pipe: Any, request: ReadRequest) -> None:
        """READ_REPLIES commands: renew, the run's status, pending entries, new entries."""
        k = self.keys
        _call_script(pipe, self._renew, [k.lease], [self.token, self.lease_ms])
        pipe.hmget(k.status, ["stop_requested", "state"])
        pipe.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER,
                        {k.gradients: request.pending_after}, count=request.count)
        pipe.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER, {k.gradients: ">"},
                        count=request.count, block=request.block_ms or None)

    def _read_result(self, replies: list[Any], count: int) -> BatchRead:
        renew, status, pending, new = replies
        for reply in (renew, status, pending, new):
            if isinstance(reply, redis.ResponseError) and str(reply).startswith("NOGROUP"):
                raise RunNotFound(f"run {self.store.run_id!r}: its gradient stream is gone")
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

    def _queue_commit(self, pipe: Any, plan: CommitPlan, params: np.ndarray) -> None:
        """SETs of the staging keys (or a no-op), then the commit script.

        The parameters travel in a plain SET of a staging key, which the script renames
        into place or deletes: passed to the script as an argument, Redis would copy them
        into a Lua string, hashing every byte (Redis' Lua interns strings with a full hash),
        and out again. No MULTI is needed around them: the script is the atomic step, and a
        staging key whose script never ran expires by itself.
        """
        k, token = self.keys, self.token
        worker_ids = list(plan.workers)
        staging = k.staging(token)
        keys = [k.lease, k.head, k.versions, k.gradients, k.metrics, k.counters,
                k.params(plan.version), staging, k.moments]
        keys += [k.params(v) for v in plan.drop] + [k.worker(w) for w in worker_ids]
        for worker_id, moment in plan.checkpoint.items():
            keys += [k.staged_moment(token, worker_id), k.moment(worker_id)]
            pipe.set(k.staged_moment(token, worker_id), f32_view(moment), px=STAGING_TTL_MS)
        keys += [k.moment(w) for w in plan.forget]
        encoded = msgpack.packb({
            "version": str(plan.version), "updates": str(plan.updates),
            "prev_id": plan.prev_id, "last_id": plan.last_id, "group": AGGREGATOR_GROUP,
            "ack": plan.ack, "publish": plan.publish, "n_drop": len(plan.drop),
            "drop": [str(v) for v in plan.drop],
            "metrics": _flatten(plan.metrics), "metrics_maxlen": str(METRICS_MAXLEN),
            "counters": plan.counters, "final": _flatten(plan.final),
            "workers": [{"id": w, "set": _flatten(plan.workers[w][0]),
                         "incr": plan.workers[w][1]} for w in worker_ids],
            "checkpoint": list(plan.checkpoint), "forget": plan.forget,
        })
        if plan.publish:
            pipe.set(staging, f32_view(params), px=STAGING_TTL_MS)
        else:
            pipe.exists(staging)  # keeps the reply count fixed
        _call_script(pipe, self._commit, keys, [token, self.lease_ms, encoded])


#: Replies of one read (Leadership._queue_read).
READ_REPLIES = 4


def _commit_result(reply: Any) -> bool:
    if isinstance(reply, redis.ResponseError):
        raise _fenced_or(reply)
    if isinstance(reply, Exception):
        raise reply
    return bool(reply)


def _call_script(pipe: Any, script: Script, keys: list[str], args: list[Any]) -> None:
    # By name: redis-py's cluster pipeline refuses its evalsha method (for fear of NOSCRIPT,
    # which _with_scripts handles), not the command.
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


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
