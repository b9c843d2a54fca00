"""The worker: stateless. Read parameters when they change, compute a gradient, publish it.

A worker keeps nothing the run needs: it can be killed at any moment and a new one started
under any id. GEM's per-worker state lives in the aggregator.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import redis
import torch
from torch import nn

from gemq import codec
from gemq.config import RunConfig
from gemq.connection import TRANSIENT_ERRORS, Backoff, connect
from gemq.data import DataSplit, load_dataset, minibatches, worker_seed
from gemq.errors import GemqError, PublishRefused
from gemq.flatmodel import FlatModel
from gemq.losses import load_loss
from gemq.models import build_model, layout_of
from gemq.process import die_with_parent, graceful_shutdown, keep_freed_memory, setup_logging
from gemq.store import ENDED, RunState, RunStore, StepView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    device: str = "cpu"
    #: While the stream is over its bound, check again after this long (s).
    backpressure_poll_s: float = 0.005
    #: A waiting worker still heartbeats this often (s), so it shows as alive.
    heartbeat_s: float = 1.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise GemqError(f"--device {name}: CUDA is not available on this machine")
    return torch.device(name)


class Worker:
    """One logical worker of one run."""

    def __init__(self, store: RunStore, worker_id: str, config: RunConfig, data: DataSplit,
                 options: WorkerOptions | None = None) -> None:
        self.store = store
        self.worker_id = worker_id
        self.config = config
        self.options = options or WorkerOptions()
        self.device = resolve_device(self.options.device)
        self.layout_id = store.layout().layout_id
        self.net = FlatModel(self._build_model(data), self.device, load_loss(config.loss),
                             config.loss, config.amp)
        self.batches = minibatches(data.train, config.batch_size,
                                   worker_seed(config.seed, worker_id))
        self.steps = 0
        self.version = -1  # of the parameters loaded in the model
        self._next_view: StepView | None = None
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
        return self.steps

    def _fail_run(self, error: Exception) -> None:
        message = (f"workers could not publish for {self.config.stall_timeout_s:g}s: "
                   f"{error}")
        if self.store.fail(message):
            log.error("run %s failed: %s", self.config.run_id, message)

    def _step(self, shutdown: threading.Event) -> bool:
        """One gradient (or one wait); False once the run has ended."""
        view, self._next_view = self._next_view or self.store.step_view(), None
        if view.state in ENDED:
            return False
        if view.state == RunState.CREATED or view.pending >= self.config.max_pending:
            # No aggregator yet (gradients would only go stale), or backpressure.
            self._wait(shutdown)
            return True
        if view.version != self.version:
            self.version, params = self.store.latest(view.version)  # one GET, not three
            self.net.load(params)
        loss, gradient = self.net.gradient(*next(self.batches))
        message = codec.encode(
            run_id=self.config.run_id, worker_id=self.worker_id, param_version=self.version,
            samples=self.config.batch_size, loss=loss, layout_id=self.layout_id,
            gradient=gradient, dtype=self.config.wire_dtype)
        # Also a heartbeat; and it brings back the view the next step starts from.
        self._next_view = self.store.publish_and_view(self.worker_id, message)
        self._last_heartbeat = time.monotonic()
        self.steps += 1
        return True

    def _wait(self, shutdown: threading.Event) -> None:
        if time.monotonic() - self._last_heartbeat > self.options.heartbeat_s:
            self.store.heartbeat(self.worker_id)
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
    workers = [Worker(store, worker_id, config, data, options) for worker_id in worker_ids]
    if len(workers) == 1:
        return {worker_ids[0]: workers[0].run(shutdown)}
    steps: dict[str, int] = {}
    errors: list[BaseException] = []

    def work(worker: Worker) -> None:
        try:
            steps[worker.worker_id] = worker.run(shutdown)
        except BaseException as e:  # stop the siblings, then re-raise in the caller
            errors.append(e)
            shutdown.set()

    threads = [threading.Thread(target=work, args=(w,), name=w.worker_id) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return steps


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
