"""The GEM aggregator: consume gradients in batches, apply a rule, commit each batch once.

One batch, top to bottom: a fenced XREADGROUP (only the lease holder may read) -> decode and
validate every message -> apply the valid ones one by one, in arrival order, to theta in
memory -> one atomic commit of parameters, head, XACK, metrics and counters. A crash between
read and commit leaves the batch unacknowledged; the next leader re-reads it from the group's
pending list and applies it: every gradient is applied exactly once, or rejected with a
reason. Only numpy here: the aggregator does not need torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import overload

import numpy as np
import redis

from gemq.aggregation import rejections
from gemq.aggregation.checkpoints import MomentCheckpoints
from gemq.aggregation.leadership import BatchRead, Fields, Leadership, ReadRequest
from gemq.aggregation.rejections import RejectionLog, StallWatch
from gemq.aggregation.rules import TENSOR_MEDIAN_SAMPLE, Rule, make_rule, median_sample
from gemq.aggregation.snapshots import SnapshotHistory, kept_versions
from gemq.aggregation.window import UNKNOWN_WORKER, CommitPlan, CommitWindow
from gemq.config import RunConfig
from gemq.errors import CodecError, FencedError, RunLost, RunNotFound
from gemq.ids import is_valid_worker_id
from gemq.layout import ParamLayout
from gemq.process import die_with_parent, graceful_shutdown, keep_freed_memory, setup_logging
from gemq.shards import ShardPlan
from gemq.state.connection import TRANSIENT_ERRORS, Backoff, connect
from gemq.state.keys import MESSAGE_FIELD, SENDER_FIELD
from gemq.state.retention import release_if_ended
from gemq.state.store import ENDED, RunState, RunStore, now_ms, text
from gemq.telemetry import SILENT_AGGREGATOR, AggregatorObserver
from gemq.threads import run_together
from gemq.wire import codec
from gemq.wire.codec import Message

log = logging.getLogger(__name__)

#: A gradient stream entry's fields (gemq.state.keys), as a reply names them.
_SENDER, _MESSAGE = SENDER_FIELD.encode(), MESSAGE_FIELD.encode()

#: Metrics rows carry the per-tensor median pi (the dashboard's heat map) this often.
PI_TENSORS_EVERY_S = 0.2
#: Entries one commit acknowledges at most, whatever the publication policy.
MAX_WINDOW_ENTRIES = 4096
#: Bytes one read may bring in at most, counting every entry at the largest size a valid
#: gradient may have: a read of oversized junk then stays within a few times this (with
#: Redis' proto-max-bulk-len bounding each entry; see docs/reliability.md).
READ_BUDGET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class AggregatorOptions:
    #: The lease expires this long (ms) after the leader's last read or commit.
    lease_ms: int = 5000
    #: How long (ms) an idle leader blocks waiting for gradients before re-checking.
    idle_block_ms: int = 200
    #: How often (s) a standby tries to take the lease.
    standby_poll_s: float = 0.5
    #: Told how long each batch took to apply and each window to commit.
    observer: AggregatorObserver = SILENT_AGGREGATOR


class Leader:
    """The state of the aggregator while it holds the lease: theta, rule, history.

    Gradients are applied as they are read, into an open *window*; closing the window gives
    the plan of one atomic commit (parameters, head, the XACK of every entry in it). The
    run's publication policy decides when a window closes: after every read by default, or
    once ``publish_every`` updates and ``publish_interval_ms`` have passed. Nothing of an
    open window is visible in Redis, so a crash loses it whole and the next leader applies
    its entries again from the pending list: exactly once either way.
    """

    def __init__(self, store: RunStore, config: RunConfig, layout: ParamLayout,
                 observer: AggregatorObserver = SILENT_AGGREGATOR) -> None:
        head = store.head()
        params = store.snapshot(head.version)
        if params is None:
            raise RunLost(f"run {store.run_id}: the parameters of version {head.version} are "
                          "missing from Redis (was it restarted without persistence?)")
        self.store = store
        self.config = config
        self.layout = layout
        self.theta = params.copy()  # writeable float32, the central variable
        self.updates = head.updates
        self.version = head.version
        self.last_id = self.prev_id = head.last_id
        plan = ShardPlan.of(layout, config.shards)
        self.shard = plan.shards[store.shard]
        self.history = SnapshotHistory(kept_versions(config, self.shard.size),
                                       store.kept_versions(), store.snapshot)
        self.rule: Rule = make_rule(config, self.shard.param_size,
                                    buffer_momenta=self.shard.buffer_momenta(layout))
        self.checkpoints = MomentCheckpoints(config.checkpoint_overhead)
        self.expected = codec.Expected(config.run_id, plan.layout_id_of(store.shard),
                                       self.shard.size,
                                       config.wire_dtype, config.max_message_bytes)
        self._last_heard: dict[str, float] = {}
        self._registered: set[str] = set()  # senders known to have registered with the run
        self._rejections = RejectionLog(config.run_id)
        self.stall = StallWatch(config.max_rejected_in_a_row, config.stall_timeout_s)
        self._window = CommitWindow()
        self._ack: list[str] = []
        self._published_at = time.monotonic()
        self._pi_tensors_at = -math.inf
        # Workers wait while the stream holds max_pending entries, and an open window's
        # entries are still in the stream: close it well before they would all be waiting.
        # (The cap also keeps the commit's XACK within Lua's argument limit.)
        self._window_cap = max(1, min(config.max_pending // 2, MAX_WINDOW_ENTRIES))
        self.observer = observer
        self._restore_moments()

    def _restore_moments(self) -> None:
        """Start from the moments of the last checkpoint (a restart keeps GEM's state)."""
        version, moments = self.store.checkpointed_moments()
        if not moments:
            return
        self.rule.restore(moments)
        now = time.monotonic()
        for worker_id in self.rule.workers:  # silent ones expire as if heard at the restart
            self._last_heard[worker_id] = now
        log.info("run %s: restored the GEM moments of %d workers checkpointed at version %d",
                 self.config.run_id, len(moments), version)

    @property
    def budget_spent(self) -> bool:
        return self.updates >= self.config.budget_updates

    @property
    def read_count(self) -> int:
        """Entries per read: ``read_batch``, fewer for large gradients (READ_BUDGET_BYTES)."""
        return max(1, min(self.config.read_batch,
                          READ_BUDGET_BYTES // self.expected.byte_limit))

    @property
    def window_entries(self) -> int:
        """Entries read since the last commit (applied, rejected or unused)."""
        return len(self._ack)

    def absorb(self, entries: list[tuple[str, Message | None, str | None]]) -> None:
        """Apply entries into the open window, in arrival order."""
        started = time.perf_counter()
        self._learn_registered({sender for _, _, sender in entries if sender is not None})
        for entry_id, message, sender in entries:
            if self.budget_spent:
                self._window.count("unused", self._attributed(sender))
            else:
                self._process_one(message, sender, self._window)
            self._ack.append(entry_id)
        if entries:
            # The newest id taken. Entries a deposed leader moved into the pending list come
            # back later, older than it: the head's last_id must not go back to them.
            self.last_id = max((self.last_id, *(e[0] for e in entries)), key=_stream_order)
            self.observer.batch_applied(len(entries), time.perf_counter() - started)

    def commit_due(self) -> bool:
        """Whether the open window should be committed now, by the publication policy."""
        if not self._ack:
            return False
        applied = self._window.applied
        if applied == 0 or len(self._ack) >= self._window_cap:
            return True  # nothing to publish (acknowledge at once), or the stream fills up
        waited_ms = (time.monotonic() - self._published_at) * 1000
        return (applied >= self.config.publish_every
                and waited_ms >= self.config.publish_interval_ms)

    def close(self) -> CommitPlan:
        """The plan that commits the open window; a new window opens."""
        window, ack = self._window, self._ack
        self._window, self._ack = CommitWindow(), []
        publish = window.applied > 0
        dropped: list[int] = []
        if publish:
            self.version = self.updates
            dropped = self.history.add(self.version, self.theta)
            self._published_at = time.monotonic()
        self._expire_silent_workers()
        metrics = (window.metrics(self.updates, len(self.rule.workers), self._pi_tensors())
                   if publish else {})
        plan = CommitPlan(version=self.version, updates=self.updates, prev_id=self.prev_id,
                          last_id=self.last_id, ack=ack, publish=publish, drop=dropped,
                          metrics=metrics, counters=window.counters, workers=window.workers)
        if publish and self.checkpoints.due():
            plan.checkpoint, plan.forget = self.checkpoints.take(self.rule)
        self.prev_id = self.last_id
        return plan

    def process(self, entries: list[tuple[str, Message | None, str | None]]) -> CommitPlan:
        """Apply a batch in arrival order; return the plan that commits it alone."""
        self.absorb(entries)
        return self.close()

    def _learn_registered(self, senders: set[str]) -> None:
        """Ask Redis, in one round trip, which senders never seen before registered."""
        new = sorted(senders - self._registered)
        known = self.store.registered(new)
        self._registered.update(s for s, ok in zip(new, known, strict=True) if ok)

    def _attributed(self, sender: str | None) -> str:
        """Who a rejection is counted under: the sender, if it is a registered worker."""
        return sender if sender in self._registered else UNKNOWN_WORKER

    def _process_one(self, message: Message | None, sender: str | None,
                     window: CommitWindow) -> None:
        try:
            msg = codec.decode(message if message is not None else b"", self.expected)
            _check_sender(sender, msg.worker_id, self._registered)
            staleness, snapshot = self._snapshot_for(msg.param_version)
        except CodecError as e:
            self._reject(e, self._attributed(sender), window)
            return
        stats = self.rule.apply(self.theta, msg.gradient, snapshot, msg.worker_id, staleness)
        self.updates += 1
        self._last_heard[msg.worker_id] = time.monotonic()
        self.stall.applied()
        window.applied_update(msg, stats)

    def _snapshot_for(self, version: int) -> tuple[int, np.ndarray]:
        if version > self.version:
            raise CodecError(rejections.FUTURE_VERSION, f"version {version} was never "
                             f"published (newest is {self.version})")
        staleness = self.updates - version
        if staleness > self.config.max_staleness:
            raise CodecError(rejections.TOO_STALE,
                             f"computed on version {version}, {staleness} updates ago")
        snapshot = self.history.get(version)
        if snapshot is None:
            raise CodecError(rejections.SNAPSHOT_GONE, f"computed on version {version}, "
                             f"{staleness} updates ago, whose snapshot is no longer kept "
                             f"(the newest {self.history.limit} are)")
        return staleness, snapshot

    def _reject(self, error: CodecError, worker_id: str, window: CommitWindow) -> None:
        window.count(f"rejected:{error.reason}", worker_id)
        if worker_id != UNKNOWN_WORKER:
            # The watchdog judges the run's own workers: junk from senders that never
            # registered is counted and logged, but cannot fail a healthy run.
            self.stall.rejected(error.reason)
        self._rejections.rejected(worker_id, error)

    def _pi_tensors(self) -> list[float | None] | None:
        """Per-tensor median pi of the last update, at most every PI_TENSORS_EVERY_S: the
        heat map needs no more, and commits can come hundreds of times a second. One entry
        per parameter tensor of the run, None for those of other shards."""
        now = time.monotonic()
        if now - self._pi_tensors_at < PI_TENSORS_EVERY_S and not self.budget_spent:
            return None
        self._pi_tensors_at = now
        scale = self.rule.last_scale()
        medians: list[float | None] = [None] * len(self.layout.params)
        index = {t.name: i for i, t in enumerate(self.layout.params)}
        for tensor, part in self.shard.tensors(self.layout):
            medians[index[tensor.name]] = median_sample(scale[part], TENSOR_MEDIAN_SAMPLE)
        return medians

    def _expire_silent_workers(self) -> None:
        cutoff = time.monotonic() - self.config.worker_timeout_s
        for worker_id, heard in list(self._last_heard.items()):
            if heard < cutoff:
                log.info("run %s: worker %s silent for %.0fs; dropping its state",
                         self.config.run_id, worker_id, self.config.worker_timeout_s)
                self.rule.forget(worker_id)
                self.checkpoints.forgotten(worker_id)
                del self._last_heard[worker_id]


class Aggregator:
    """Lead one shard of a run (``store``'s) until its budget is spent, a stop is requested
    or the run fails; stand by while another aggregator leads it."""

    def __init__(self, store: RunStore, options: AggregatorOptions | None = None) -> None:
        self.store = store
        self.options = options or AggregatorOptions()
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lead = Leadership(store, self.token, self.options.lease_ms)
        self.name = (f"run {store.run_id}" if store.shard == 0
                     else f"run {store.run_id} shard {store.shard}")

    def run(self, shutdown: threading.Event | None = None) -> str:
        """Return the shard's final state, or "shutdown" when asked to leave early.

        Redis outages are waited out with capped backoff; each new term reloads the run's
        committed state from Redis, so nothing half-done in memory survives an outage.
        """
        shutdown = shutdown or threading.Event()
        keep_freed_memory()
        outage = Backoff(f"{self.name}: aggregator")
        self.store.config()  # RunNotFound now, before anything: the run must exist
        try:
            while not shutdown.is_set():
                try:
                    outcome = self._term(shutdown)
                except RunNotFound as e:
                    raise RunLost(f"run {self.store.run_id} vanished from Redis (restarted "
                                  "without persistence?); not starting it again from "
                                  "scratch") from e
                except TRANSIENT_ERRORS as e:
                    outage.wait(shutdown, e)
                    continue
                outage.reset()
                if outcome is not None:
                    return outcome
            return "shutdown"
        finally:
            self._release_lease()

    def _term(self, shutdown: threading.Event) -> str | None:
        """Stand by, then lead; None when the lease was lost and another term should begin."""
        config, layout = self.store.config(), self.store.layout()
        if not self._wait_for_lease(shutdown):
            return "shutdown"
        # Checked under the lease: the last leader may be done, the run failed elsewhere.
        ended = self._ended()
        if ended is not None:
            log.info("%s is %s; nothing to do", self.name, ended)
            return ended
        try:
            leader = Leader(self.store, config, layout, self.options.observer)
            log.info("%s: keeps %d snapshots, so gradients up to %d updates stale are "
                     "applied", self.name, leader.history.limit,
                     min(config.max_staleness, leader.history.limit - 1))
            return self._lead(leader, shutdown)
        except FencedError as e:
            log.warning("%s: %s; standing by", self.name, e)
            return None

    def _ended(self) -> str | None:
        """The shard's final state if it has one (the run concluded if it can be), or the
        run's if the run has ended."""
        shard_state = self.store.head().state
        if shard_state is not None:
            self.store.conclude()  # a leader may have died between its last commit and this
            return shard_state
        state = self.store.state()
        return state if state in ENDED else None

    def _release_lease(self) -> None:
        # On the way out, whatever Redis says (away, restarted empty): the lease expires by
        # itself, and leaving must not hide the reason for leaving.
        with contextlib.suppress(redis.RedisError):
            self.lead.release()

    @property
    def _idle_block_ms(self) -> int:
        # Redis wakes blocked clients on its periodic timer (the server's hz), so a block may
        # last a tick longer than asked: keep it well inside the lease, which the next read
        # renews.
        return max(1, min(self.options.idle_block_ms, self.options.lease_ms // 4))

    def _wait_for_lease(self, shutdown: threading.Event) -> bool:
        """Take the lease (True), or give up on shutdown or once the run has ended."""
        announced = False
        while not shutdown.is_set():
            if self.lead.acquire():
                log.info("%s: leading as %s", self.name, self.token)
                return True
            if self.store.state() in ENDED or self.store.head().state is not None:
                return True  # the caller sees the state and leaves
            if not announced:
                log.info("%s: another aggregator holds the lease; standing by", self.name)
                announced = True
            shutdown.wait(self.options.standby_poll_s)
        return False

    def _lead(self, leader: Leader, shutdown: threading.Event) -> str:
        self.store.mark_running(self.token)
        # A new leader may inherit its predecessor's unacknowledged batch: read it first.
        read = self.lead.read(ReadRequest(leader.read_count, pending_after="0"))
        while True:
            leader.absorb([(entry_id, _field(f, _MESSAGE), _sender(f))
                           for entry_id, f in read.entries])
            final, fields = _final_state(leader, read)
            idle = not read.entries  # nothing came while blocked: flush what is open
            if final or shutdown.is_set():
                last = leader.close()
                last.final = fields
                if final or last.ack:
                    self._commit(last, leader)
                if final:
                    self.store.conclude()
                    log.log(logging.ERROR if final == RunState.FAILED else logging.INFO,
                            "%s %s after %d updates%s", self.name, final, leader.updates,
                            f": {fields['error']}" if "error" in fields else "")
                    return final
                return "shutdown"
            due = (idle and leader.window_entries) or leader.commit_due()
            plan = leader.close() if due else None
            request = self._next_read(leader, read)
            read = (self._commit(plan, leader, request) if plan is not None
                    else self.lead.read(request))

    def _next_read(self, leader: Leader, last: BatchRead) -> ReadRequest:
        """The next read: new entries, waiting for them inside the same round trip; but the
        pending list while it may hold entries nobody took (the term's first read reads
        it too), from its start at a window's start, past the entries already taken within
        one. In steady state each entry is then delivered once."""
        count, taken = leader.read_count, leader.window_entries
        if last.backlog:
            return ReadRequest(count, leader.last_id if taken else "0", taken)
        return ReadRequest(count, taken=taken, block_ms=self._idle_block_ms)

    @overload
    def _commit(self, plan: CommitPlan, leader: Leader) -> None: ...

    @overload
    def _commit(self, plan: CommitPlan, leader: Leader, then: ReadRequest) -> BatchRead: ...

    def _commit(self, plan: CommitPlan, leader: Leader,
                then: ReadRequest | None = None) -> BatchRead | None:
        """Commit ``plan``, and make the read ``then`` in the same round trip."""
        read = None
        started = time.monotonic()
        if then is None:
            committed = self.lead.commit(plan, leader.theta)
        else:
            committed, read = self.lead.commit_then_read(plan, leader.theta, then)
        if not committed and self.store.head().last_id != plan.last_id:
            # Not merely our own commit, re-sent after a lost reply.
            raise FencedError("the run's head moved under this aggregator")
        self.options.observer.window_committed(len(plan.ack), time.monotonic() - started)
        if plan.checkpoint:
            leader.checkpoints.done(time.monotonic() - started)
        return read


def _final_state(leader: Leader, read: BatchRead) -> tuple[RunState | None, dict[str, object]]:
    """Whether the shard ends with this window: its final state, and the fields its commit
    sets in the shard's head (the run's status follows from the shards': RunStore.conclude)."""
    state, error = None, None
    if leader.budget_spent:
        state = RunState.FINISHED
    elif read.failed:  # by a worker, or by another shard's aggregator: its error stands
        state = RunState.FAILED
    elif (stalled := leader.stall.stalled()) is not None:
        state, error = RunState.FAILED, stalled
    elif read.stop_requested:
        state = RunState.STOPPED
    if state is None:
        return None, {}
    fields: dict[str, object] = {"state": state, "ended_ms": now_ms()}
    if error:
        fields["error"] = error
    return state, fields


def _check_sender(sender: str | None, worker_id: str, registered: set[str]) -> None:
    """No entry without a valid, registered sender that matches its header is applied."""
    if sender is None:
        raise CodecError(rejections.BAD_SENDER,
                         f"the entry has no valid sender (field {SENDER_FIELD})")
    if sender != worker_id:
        raise CodecError(rejections.BAD_SENDER,
                         f"header worker {worker_id!r} differs from sender {sender!r}")
    if sender not in registered:
        raise CodecError(rejections.UNKNOWN_SENDER,
                         f"worker {sender!r} never registered with the run")


def _stream_order(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


def _field(fields: Fields | None, name: bytes) -> Message | None:
    return None if fields is None else fields.get(name)


def _sender(fields: Fields | None) -> str | None:
    """The worker id the entry was published under, when it is a valid one."""
    raw = _field(fields, _SENDER)
    try:
        sender = text(raw) if raw is not None else None
    except UnicodeDecodeError:
        return None
    return sender if sender is not None and is_valid_worker_id(sender) else None


def lead_shards(stores: list[RunStore], options: AggregatorOptions,
                shutdown: threading.Event) -> list[str]:
    """Lead each of ``stores``' shards, one thread each; return their final states. An
    error in one shard's aggregator stops the others."""
    return run_together([(f"shard-{s.shard}", Aggregator(s, options).run) for s in stores],
                        shutdown)


def aggregator_main(url: str, run_id: str, lease_ms: int, shard: int = 0) -> None:
    """Entry point of a local aggregator process for one shard (numpy only: no torch)."""
    shutdown = graceful_shutdown(ignore_sigint=True)
    die_with_parent()  # a local run's aggregator must not outlive `gemq run`, however it ends
    setup_logging(logging.WARNING)
    client = connect(url)
    try:
        store = RunStore(client, run_id, shard)
        final = Aggregator(store, AggregatorOptions(lease_ms=lease_ms)).run(shutdown)
        release_if_ended(store, final)
    finally:
        client.close()
