"""The aggregator service: an rq worker that takes aggregation jobs off the queue, and the
standby that takes over a running run whose aggregator died.

rq alone cannot do the second part: when the pod running a job dies, rq only marks the job
abandoned. So every replica also watches for running runs whose lease has expired and leads
them itself; the lease and its fencing keep two replicas from ever writing one run at once.

``gemq aggregator --serve`` or ``python -m gemq.services.aggregator``. Needs numpy, not torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading

import redis
from rq import Worker
from rq.serializers import JSONSerializer

from gemq.aggregator import Aggregator, AggregatorOptions
from gemq.connection import TRANSIENT_ERRORS, Backoff, connect, redact
from gemq.errors import GemqError, RunNotFound
from gemq.process import setup_logging
from gemq.store import RunState, RunStore, run_ids

from .jobs import queue
from .probe import start_heartbeat
from .settings import AggregatorServiceSettings, load

log = logging.getLogger(__name__)


def orphaned_runs(client: redis.Redis) -> list[str]:
    """Runs in state ``running`` that no aggregator holds the lease of."""
    orphans = []
    for run_id in run_ids(client, 100):
        store = RunStore(client, run_id)
        with contextlib.suppress(RunNotFound):
            if store.state() == RunState.RUNNING and not client.exists(store.keys.lease):
                orphans.append(run_id)
    return orphans


def watch_orphans(settings: AggregatorServiceSettings, shutdown: threading.Event) -> None:
    """Lead every orphaned run, one thread each, until ``shutdown``."""
    client = connect(settings.redis_url, wait_s=float("inf"))
    leading: dict[str, threading.Thread] = {}
    outage = Backoff("aggregator service standby")
    while not shutdown.wait(settings.lease_ms / 1000):
        try:
            orphans = orphaned_runs(client)
        except TRANSIENT_ERRORS as e:
            outage.wait(shutdown, e)
            continue
        outage.reset()
        for run_id in orphans:
            if run_id not in leading or not leading[run_id].is_alive():
                log.warning("run %s is running without an aggregator; taking it over", run_id)
                leading[run_id] = threading.Thread(
                    target=_lead_orphan, args=(client, run_id, settings, shutdown),
                    name=f"standby-{run_id}", daemon=True)
                leading[run_id].start()


def _lead_orphan(client: redis.Redis, run_id: str, settings: AggregatorServiceSettings,
                 shutdown: threading.Event) -> None:
    try:
        final = Aggregator(RunStore(client, run_id),
                           AggregatorOptions(lease_ms=settings.lease_ms)).run(shutdown)
        log.info("run %s: %s", run_id, final)
    except GemqError as e:
        log.error("run %s: %s", run_id, e)


def serve(settings: AggregatorServiceSettings) -> None:
    start_heartbeat(settings.heartbeat_file)
    client = connect(settings.redis_url, wait_s=float("inf"))
    threading.Thread(target=watch_orphans, args=(settings, threading.Event()),
                     name="standby", daemon=True).start()
    name = f"gemq-aggregator-{socket.gethostname()}-{os.getpid()}"
    log.info("aggregator service %s: waiting for jobs on %r at %s", name,
             settings.aggregator_queue, redact(settings.redis_url))
    worker = Worker([queue(client, settings.aggregator_queue)], connection=client, name=name,
                    serializer=JSONSerializer)
    worker.work(with_scheduler=False, logging_level="INFO")


def main() -> None:
    setup_logging()
    serve(load(AggregatorServiceSettings))


if __name__ == "__main__":
    main()
