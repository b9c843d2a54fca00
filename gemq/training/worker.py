"""The worker: stateless. Read parameters when they change, compute a gradient, publish it.

A worker keeps nothing the run needs: it can be killed at any moment and a new one started
under any id. GEM's per-worker state lives in the aggregator.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import redis
import torch
from torch import nn

from gemq.config import RunConfig
from gemq.errors import ConfigError, GemqError, PublishRefused
from gemq.logs import log_context
from gemq.process import die_with_parent, graceful_shutdown, keep_freed_memory, setup_logging
from gemq.state.connection import TRANSIENT_ERRORS, Backoff, connect
from gemq.state.store import ENDED, RunState, RunStore, StepView
from gemq.telemetry import SILENT_WORKER, WorkerObserver
from gemq.threads import run_together
from gemq.training.data import DataSplit, load_dataset, minibatches, worker_seed
from gemq.training.flatmodel import FlatModel
from gemq.training.heldout import HeldOutEvaluation
from gemq.training.losses import load_loss
from gemq.training.models import build_model, layout_of
from gemq.training.shardset import RunShards, SharedReads
from gemq.wire import codec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    device: str = "cpu"
    #: While the stream is over its bound, check again after this long (s).
    backpressure_poll_s: float = 0.005
    #: A waiting worker still heartbeats this often (s), so it shows as alive.
    heartbeat_s: float = 1.0
    #: Told how long each gradient took to compute and to publish.
    observer: WorkerObserver = SILENT_WORKER


def resolve_device(name: str) -> torch.device:
    """The torch device a worker computes on: ``auto``, ``cpu`` or ``cuda[:N]`` (or another
    device type torch knows). Anything else, or a CUDA device this machine lacks, is one
    ConfigError naming the flag, raised before any process or Redis is started."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError("device", f"unknown device {name!r}: use auto, cpu or "
                                    f"cuda[:N]") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{name}: CUDA is not available on this machine "
                                        f"(use cpu or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError("device", f"{name}: this machine has "
                                        f"{torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ConfigError("device", f"unknown device {name!r}: use auto, cpu or cuda[:N]")
    return device


class Worker:
    """One logical worker of one run."""

    def __init__(self, store: RunStore, worker_id: str, config: RunConfig, data: DataSplit,
                 options: WorkerOptions | None = None,
                 shared: SharedReads | None = None) -> None:
        self.store = store
        self.worker_id = worker_id
        self.config = config
        self.options = options or WorkerOptions()
        self.device = resolve_device(self.options.device)
        self.layout_id = store.layout().layout_id
        self.shards = RunShards(store, shared)
        loss = load_loss(config.loss)
        self.net = FlatModel(self._build_model(data), self.device, loss, config.loss,
                             config.amp)
        self.held_out = HeldOutEvaluation(store, config, data.test, loss)
        self.batches = minibatches(data.train, config.batch_size,
                                   worker_seed(config.seed, worker_id))
        self.steps = 0
        #: Each shard's version of the parameters loaded in the model (-1: none yet).
        self.versions = [-1] * self.shards.count
        #: The whole state the model was loaded from, assembled from the shards' slices.
        self._state = np.zeros(self.shards.plan.size, dtype=np.float32)
        self._next_views: list[StepView] | None = None
        self._last_heartbeat = 0.0

    def _build_model(self, data: DataSplit) -> nn.Module:
        model = build_model(self.config.model, data.in_features, data.num_classes)
        if layout_of(model).layout_id != self.layout_id:
            raise GemqError(f"model {self.config.model!r} does not match the parameter layout "
                            f"of run {self.config.run_id!r}")
        return model

    def run(self, shutdown: threading.Event) -> int:
        """Work until the run ends or ``shutdown`` is set; return the steps published.

        A Redis outage costs the step in flight (it is computed again on fresh parameters
        once Redis answers), never a duplicate: the client does not re-send commands. Any
        other Redis error (a refused gradient, say) is reported and retried with backoff;
        if it lasts the run's stall_timeout_s, the worker fails the run with it.
        """
        outage = Backoff(f"worker {self.worker_id}")
        refusals = Refusals(self.worker_id, self.config.stall_timeout_s)
        try:
            while not shutdown.is_set():
                try:
                    if not self._step(shutdown):
                        break
                except TRANSIENT_ERRORS as e:
                    outage.wait(shutdown, e)
                    continue
                except (PublishRefused, redis.ResponseError) as e:
                    if refusals.persisted(e):
                        self._fail_run(e)
                        break
                    refusals.wait(shutdown)
                    continue
                outage.reset()
                refusals.reset()
        finally:
            self.shards.close()
        return self.steps

    def _fail_run(self, error: Exception) -> None:
        message = (f"workers could not publish for {self.config.stall_timeout_s:g}s: "
                   f"{error}")
        if self.store.fail(message):
            log.error("run %s failed: %s", self.config.run_id, message)

    @property
    def version(self) -> int:
        """The version of the parameters loaded (shard 0's, for a sharded run)."""
        return self.versions[0]

    def _step(self, shutdown: threading.Event) -> bool:
        """One gradient (or one wait); False once the run has ended."""
        views, self._next_views = self._next_views or self.shards.views(), None
        state = views[0].state  # the run's
        if state in ENDED:
            return False
        # Backpressure per shard: a shard whose stream is full (its aggregator slow, or gone
        # until a standby takes over) gets no slice of this step; the others go on.
        room = [k for k, v in enumerate(views) if v.pending < self.config.max_pending]
        if state == RunState.CREATED or not room:
            # No aggregator yet (gradients would only go stale), or every shard is full.
            self._wait(shutdown)
            return True
        self._load_newer({k: v.version for k, v in enumerate(views)
                          if v.version != self.versions[k]})
        self.held_out.evaluate_if_due(self.version, self.net.model)
        started = time.perf_counter()
        step = self.net.gradient(*next(self.batches))
        shards = self.shards.plan.shards
        messages = {k: codec.encode(  # each slice carries the whole step's loss, accuracy
            run_id=self.config.run_id, worker_id=self.worker_id,
            param_version=self.versions[k], samples=self.config.batch_size,
            loss=step.loss, accuracy=step.accuracy,
            layout_id=self.shards.plan.layout_id_of(k),
            gradient=step.output[shards[k].slice], dtype=self.config.wire_dtype)
            for k in room}
        computed = time.perf_counter()
        # Also a heartbeat; and it brings back the views the next step starts from.
        self._next_views = self.shards.publish(self.worker_id, messages)
        self.options.observer.step_computed(computed - started)
        self.options.observer.gradient_published(sum(map(len, messages.values())),
                                                 time.perf_counter() - computed)
        self._last_heartbeat = time.monotonic()
        self.steps += 1
        return True

    def _load_newer(self, versions: dict[int, int]) -> None:
        """Load the shards whose version moved (one round trip for all of them)."""
        if not versions:
            return
        found = self.shards.snapshots(versions)
        if self.shards.count == 1:
            (self.versions[0], params), = found.values()
            self.net.load(params)
            return
        for k, (version, params) in found.items():
            self.versions[k] = version
            self._state[self.shards.plan.shards[k].slice] = params
        self.net.load(self._state)

    def _wait(self, shutdown: threading.Event) -> None:
        if time.monotonic() - self._last_heartbeat > self.options.heartbeat_s:
            self.shards.heartbeat(self.worker_id)
            self._last_heartbeat = time.monotonic()
        shutdown.wait(self.options.backpressure_poll_s)



class Refusals:
    """A worker's run of Redis errors that retrying does not cure: reported once, waited
    out with capped backoff, and called persistent after ``limit_s``."""

    def __init__(self, worker_id: str, limit_s: float, first_s: float = 0.1,
                 cap_s: float = 5.0) -> None:
        self.worker_id, self.limit_s = worker_id, limit_s
        self.first_s, self.cap_s = first_s, cap_s
        self.delay = first_s
        self.since: float | None = None

    def persisted(self, error: Exception) -> bool:
        """Note ``error``; True once errors have lasted ``limit_s`` without a success."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning("worker %s: %s; retrying with backoff", self.worker_id, error)
        return now - self.since >= self.limit_s

    def wait(self, stop: threading.Event) -> None:
        stop.wait(self.delay)
        self.delay = min(self.delay * 2, self.cap_s)

    def reset(self) -> None:
        if self.since is not None:
            log.info("worker %s: Redis takes gradients again", self.worker_id)
        self.delay, self.since = self.first_s, None


def run_workers(store: RunStore, worker_ids: list[str], options: WorkerOptions,
                shutdown: threading.Event) -> dict[str, int]:
    """Host several logical workers of one run in this process, one thread each."""
    keep_freed_memory()
    config = store.config()
    data = load_dataset(config.dataset)
    shared = SharedReads()  # the process's workers read each new version once between them
    workers = [Worker(store, worker_id, config, data, options, shared)
               for worker_id in worker_ids]
    steps = run_together([(w.worker_id, functools.partial(_run_logged, w)) for w in workers],
                         shutdown)
    return dict(zip(worker_ids, steps, strict=True))


def _run_logged(worker: Worker, shutdown: threading.Event) -> int:
    """``worker.run``, its log lines marked with its run and id."""
    with log_context(run=worker.config.run_id, worker=worker.worker_id):
        return worker.run(shutdown)


def worker_main(url: str, run_id: str, worker_ids: list[str], device: str,
                niceness: int = 0) -> None:
    """Entry point of a local worker process hosting ``worker_ids``."""
    shutdown = graceful_shutdown(ignore_sigint=True)
    die_with_parent()  # a local run's workers must not outlive `gemq run`, however it ends
    setup_logging(logging.WARNING)
    if niceness:
        os.nice(niceness)
    torch.set_num_threads(1)  # many workers share few cores: one thread each
    client = connect(url, retries=0)
    try:
        run_workers(RunStore(client, run_id), worker_ids, WorkerOptions(device=device),
                    shutdown)
    finally:
        client.close()
