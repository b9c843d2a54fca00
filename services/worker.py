"""The worker service: stays up between runs, joins whichever run is running.

``gemq worker --follow`` or ``python -m gemq.services.worker``. It waits for a running run,
works on it until it ends, then waits for the next one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import redis
import torch

from gemq import logs
from gemq.errors import GemqError, RunNotFound
from gemq.process import graceful_shutdown
from gemq.state.connection import TRANSIENT_ERRORS, Backoff, connect, redact
from gemq.state.store import RunState, RunStore, run_ids
from gemq.telemetry import SILENT_WORKER, WorkerObserver
from gemq.training.worker import WorkerOptions, resolve_device, run_workers

from .probe import start_heartbeat
from .settings import WorkerServiceSettings, load

log = logging.getLogger(__name__)


def running_run(client: redis.Redis, only: str | None = None) -> str | None:
    """The newest run in state ``running`` (or ``only``, if it is running)."""
    candidates = [only] if only else run_ids(client, 50)
    for run_id in candidates:
        try:
            if RunStore(client, run_id).state() == RunState.RUNNING:
                return run_id
        except RunNotFound:
            continue
    return None


def follow(settings: WorkerServiceSettings, shutdown: threading.Event) -> None:
    logs.configure(settings.log_level, settings.log_format)
    resolve_device(settings.device)  # a wrong GEMQ_DEVICE: one line, before waiting for runs
    if settings.workers > 1:
        torch.set_num_threads(1)  # one thread per logical worker
    start_heartbeat(settings.heartbeat_file, stop=shutdown)
    options = WorkerOptions(settings.device, observer=_metrics(settings.metrics_port))
    client = connect(settings.redis_url, wait_s=float("inf"), retries=0)
    prefix = f"{socket.gethostname()}-{os.getpid()}"
    ids = [prefix] if settings.workers == 1 else [f"{prefix}-{i}"
                                                  for i in range(settings.workers)]
    log.info("worker service %s (%d workers): waiting for a running run at %s", prefix,
             len(ids), redact(settings.redis_url))
    outage = Backoff("worker service")
    try:
        while not shutdown.is_set():
            try:
                run_id = running_run(client, settings.run)
            except TRANSIENT_ERRORS as e:
                outage.wait(shutdown, e)
                continue
            outage.reset()
            if run_id is None:
                shutdown.wait(settings.poll_s)
                continue
            with logs.log_context(run=run_id):
                _work_on(client, run_id, ids, settings, options, shutdown)
    finally:
        client.close()


def _work_on(client: redis.Redis, run_id: str, ids: list[str],
             settings: WorkerServiceSettings, options: WorkerOptions,
             shutdown: threading.Event) -> None:
    log.info("joining run %s", run_id)
    try:
        steps = run_workers(RunStore(client, run_id), ids, options, shutdown)
        log.info("run %s over for us: %d gradients published", run_id, sum(steps.values()))
    except TRANSIENT_ERRORS as e:
        log.warning("lost Redis while joining run %s (%s); looking again", run_id, e)
    except GemqError as e:  # a run we cannot work on must not stop the service
        log.error("cannot work on run %s: %s; waiting for the next run", run_id, e)
        _wait_until_not_running(client, run_id, settings, shutdown)


def _wait_until_not_running(client: redis.Redis, run_id: str,
                            settings: WorkerServiceSettings, shutdown: threading.Event) -> None:
    while not shutdown.is_set() and running_run(client, run_id) == run_id:
        shutdown.wait(settings.poll_s)


def _metrics(port: int | None) -> WorkerObserver:
    """The service's /metrics on ``port`` (none without one), and the observer whose
    histograms it serves."""
    if port is None:
        return SILENT_WORKER
    from . import telemetry  # prometheus_client only where metrics are served

    observer = telemetry.serve_worker_metrics(port)
    log.info("worker metrics on http://%s:%d/metrics", telemetry.LISTEN_ADDRESS, port)
    return observer


def main() -> None:
    follow(load(WorkerServiceSettings), graceful_shutdown())


if __name__ == "__main__":
    main()
