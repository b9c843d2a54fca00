"""The lease holder's side of a shard in Redis: the lease, fenced reads, atomic commits.

Only the aggregator holding a shard's lease reads its gradient stream and commits to it. A
commit is one Lua script (gemq/state/scripts.py: COMMIT) that first checks the lease is still
the caller's, then that the head is the one the window was computed from: a deposed leader
writes nothing. Reads need no fence: a deposed leader's read only moves entries into the
pending list. Every read also counts the pending list, so the leader knows when the list
holds entries it has not taken, and reads them before anything new.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from gemq.aggregation.window import CommitPlan
from gemq.errors import FencedError, RunNotFound
from gemq.state import scripts
from gemq.state.keys import AGGREGATOR_CONSUMER, AGGREGATOR_GROUP
from gemq.state.store import METRICS_MAXLEN, RunState, RunStore, f32_view
from gemq.wire.codec import Message

#: A stream entry's fields (the gradient, a memoryview when large: gemq/state/bulkreads.py).
Fields = dict[bytes, Message]
#: A staged parameter vector whose commit script never ran (the leader died between its SET
#: and the script, or was fenced) is deleted by Redis after this long.
STAGING_TTL_MS = 60_000


@dataclass(frozen=True)
class ReadRequest:
    """How the aggregator's next read is made (see Leadership.read)."""

    count: int
    #: Read the pending list past this id ("0": from its start); None: new entries.
    pending_after: str | None = None
    #: Entries the reader took and has not acknowledged yet, all with ids up to
    #: pending_after: the pending list holds these, and whatever else it holds nobody took.
    taken: int = 0
    #: How long a read of new entries may wait for one (ms; 0: not at all).
    block_ms: int = 0


@dataclass(frozen=True)
class BatchRead:
    """What one fenced read returned."""

    stop_requested: bool
    #: The run was failed meanwhile (by a worker that cannot publish, or another shard's
    #: aggregator): stop leading.
    failed: bool
    #: (stream id, fields or None), in stream order.
    entries: list[tuple[str, Fields | None]]
    #: Whether the pending list may still hold entries nobody took (a predecessor's batch,
    #: a deposed leader's read, a first attempt answered NOSCRIPT): the next read should
    #: read the pending list, as new entries would pass them.
    backlog: bool


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
        """Take the lease if nobody holds it. A new term then loads the scripts its
        pipelines call by SHA: a read answered NOSCRIPT still moves entries into the
        pending list, to be delivered again."""
        if not self._r.set(self.keys.lease, self.token, nx=True, px=self.lease_ms):
            return False
        self._load_scripts()
        return True

    def _load_scripts(self) -> None:
        for script in (self._renew, self._commit):
            self._r.script_load(script.script)

    def release(self) -> None:
        self._release(keys=[self.keys.lease], args=[self.token])

    def read(self, request: ReadRequest | int) -> BatchRead:
        """Renew the lease and read a batch, in one round trip (a count n: ReadRequest(n),
        new entries).

        A read of the pending list returns entries delivered earlier but never
        acknowledged (a previous leader's batch, a deposed leader's read) with ids above
        ``pending_after``; fields are None for an entry deleted while pending. A read of
        new entries returns none while the pending list holds entries nobody took: they
        come first (``backlog``). With ``block_ms``, Redis holds the reply up to that long
        while no new entry exists, so an idle leader waits without another round trip.
        """
        read = request if isinstance(request, ReadRequest) else ReadRequest(request)
        # A read whose script Redis lacked still moved entries into the pending list; the
        # second attempt counts them there, and reads them before new ones.
        replies = self._with_scripts(lambda pipe: self._queue_read(pipe, read))
        return self._read_result(replies, read)

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
        return committed, self._read_result(replies[-READ_REPLIES:], request)

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
                self._load_scripts()
                continue
            break
        return replies

    def _queue_read(self, pipe: Any, request: ReadRequest) -> None:
        """READ_REPLIES commands: renew, the run's status, the pending list's size, the
        entries."""
        k = self.keys
        _call_script(pipe, self._renew, [k.lease], [self.token, self.lease_ms])
        pipe.hmget(k.status, ["stop_requested", "state"])
        pipe.xpending(k.gradients, AGGREGATOR_GROUP)
        if request.pending_after is not None:
            pipe.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER,
                            {k.gradients: request.pending_after}, count=request.count)
        else:
            pipe.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER, {k.gradients: ">"},
                            count=request.count, block=request.block_ms or None)

    def _read_result(self, replies: list[Any], request: ReadRequest) -> BatchRead:
        _, status, summary, read = replies
        for reply in replies:
            if isinstance(reply, redis.ResponseError) and str(reply).startswith("NOGROUP"):
                raise RunNotFound(f"run {self.store.run_id!r}: its gradient stream is gone")
            if isinstance(reply, Exception):
                raise _fenced_or(reply) if isinstance(reply, redis.ResponseError) else reply
        stop, failed = status[0] is not None, status[1] == RunState.FAILED.encode()
        entries = _entries(read)
        # Counted before this read: the list held the entries taken earlier, and the rest
        # nobody had taken (some of which a pending read just took).
        untaken = _held(summary) - request.taken
        if request.pending_after is not None:
            return BatchRead(stop, failed, entries, backlog=untaken > len(entries))
        if untaken > 0:
            # Older than the new entries just read: those stay pending behind them, and
            # come back through pending reads, in order.
            return BatchRead(stop, failed, [], backlog=True)
        return BatchRead(stop, failed, entries, backlog=False)

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
                k.params(plan.version), staging, k.moments, k.evaluations]
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


def _held(summary: dict[str, Any]) -> int:
    """Entries the aggregators' consumer holds, from an XPENDING summary (pending reads
    return that consumer's)."""
    return next((c["pending"] for c in summary["consumers"]
                 if c["name"] in (AGGREGATOR_CONSUMER, AGGREGATOR_CONSUMER.encode())), 0)


def _fenced_or(error: Exception) -> Exception:
    return FencedError(str(error)) if str(error).startswith("FENCED") else error
