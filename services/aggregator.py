"""The aggregator service: an rq worker that takes aggregation jobs off the queue, and the
standby that takes over a running run whose aggregator died.

rq alone cannot do the second part: when the pod running a job dies, rq only marks the job
abandoned. So every replica also watches for running runs whose lease has expired and leads
them itself; the lease and its fencing keep two replicas from ever writing one run at once.

SIGTERM (a pod being stopped) ends the service within SHUTDOWN_DEADLINE_S whatever Redis
does. If Redis answers, the work horse is told to commit its batch and release the run's
lease, so another replica takes the run over at once. If Redis does not answer, nothing can
be committed: the horse is killed and the service leaves at once, and the run is taken over
once its lease expires. A crash before a commit is safe by design (the next leader applies
the pending batch exactly once). Either way the horse never outlives the service.

``gemq aggregator --serve`` or ``python -m gemq.services.aggregator``. Needs numpy, not torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn

import redis
from rq import Worker
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import signal_name

from gemq import logs
from gemq.aggregation.aggregator import Aggregator, AggregatorOptions
from gemq.errors import GemqError, RunNotFound
from gemq.process import die_with_parent
from gemq.state.connection import TRANSIENT_ERRORS, Backoff, connect, redact
from gemq.state.retention import release_if_ended
from gemq.state.store import RunState, RunStore, run_ids
from gemq.telemetry import SILENT_AGGREGATOR, AggregatorObserver

from . import jobs
from .jobs import queue
from .probe import redis_error, start_heartbeat
from .settings import AggregatorServiceSettings, load

log = logging.getLogger(__name__)

#: Seconds from SIGTERM until the service is gone, whatever it was waiting for; well inside
#: the pod's terminationGracePeriodSeconds (k8s/base/aggregator.yaml).
SHUTDOWN_DEADLINE_S = 8.0
#: How long the SIGTERM handler waits for Redis to accept a connection, then to answer PING.
PING_TIMEOUT_S = 1.0
#: prometheus_client's multiprocess mode: the directory where each process writes its values.
MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
WITHOUT_COMMIT = ("leaving without a final commit; a run led here is taken over by another "
                  "aggregator once its lease expires")


def orphaned_shards(client: redis.Redis) -> list[tuple[str, int]]:
    """(run, shard) of the running runs' shards that no aggregator holds the lease of and
    that have not ended."""
    orphans = []
    for run_id in run_ids(client, 100):
        store = RunStore(client, run_id)
        with contextlib.suppress(RunNotFound):
            if store.state() != RunState.RUNNING:
                continue
            for shard in store.shards():
                if shard.leader() is None and shard.head().state is None:
                    orphans.append((run_id, shard.shard))
    return orphans


def watch_orphans(settings: AggregatorServiceSettings, shutdown: threading.Event,
                  observer: AggregatorObserver = SILENT_AGGREGATOR) -> None:
    """Lead every orphaned shard, one thread each, until ``shutdown``; then let each finish
    its batch and release its lease."""
    client = connect(settings.redis_url, wait_s=float("inf"))
    leading: dict[tuple[str, int], threading.Thread] = {}
    outage = Backoff("aggregator service standby")
    try:
        while not shutdown.wait(settings.lease_ms / 1000):
            try:
                orphans = orphaned_shards(client)
            except TRANSIENT_ERRORS as e:
                if not shutdown.is_set():  # nothing more to say once asked to leave
                    outage.wait(shutdown, e)
                continue
            outage.reset()
            for run_id, shard in orphans:
                if (run_id, shard) not in leading or not leading[run_id, shard].is_alive():
                    log.warning("run %s shard %d is running without an aggregator; taking "
                                "it over", run_id, shard)
                    leading[run_id, shard] = threading.Thread(
                        target=_lead_orphan,
                        args=(client, run_id, shard, settings, shutdown, observer),
                        name=f"standby-{run_id}-{shard}", daemon=True)
                    leading[run_id, shard].start()
        for thread in leading.values():
            thread.join()
    finally:
        client.close()


def _lead_orphan(client: redis.Redis, run_id: str, shard: int,
                 settings: AggregatorServiceSettings, shutdown: threading.Event,
                 observer: AggregatorObserver) -> None:
    options = AggregatorOptions(lease_ms=settings.lease_ms, observer=observer)
    with logs.log_context(run=run_id):
        try:
            store = RunStore(client, run_id, shard)
            final = Aggregator(store, options).run(shutdown)
            release_if_ended(store, final)
            log.info("run %s shard %d: %s", run_id, shard, final)
        except GemqError as e:
            log.error("run %s shard %d: %s", run_id, shard, e)


class AggregatorWorker(Worker):
    """rq's forking Worker, with a SIGTERM that neither waits on Redis nor leaves the work
    horse behind.

    rq's warm shutdown waits for the horse without telling it (the horse sits in a process
    group of its own, out of reach of a signal to the service's group), and writes to Redis
    from the signal handler and on the way out: with Redis gone, each write raises, the
    service exits with tracebacks and the horse goes on alone, or the writes hang. Here:
    SIGTERM first PINGs Redis. Without an answer, the horse is killed and the service leaves
    at once, with one line saying why. With one, the horse is sent SIGTERM (the job commits
    its batch, releases the lease and returns) and rq's warm shutdown runs as usual, under a
    deadline. The horse dies with the service in any case (PR_SET_PDEATHSIG).

    None of this is rq's public API: the methods overridden here, the attributes read
    (horse_pid, _stop_requested) and the horse's process group are rq's internals, as in
    rq 3.0 (rq 2.x differs: see tests/test_rq_internals.py, which names each one and
    checks it against the rq installed, so that a release that changes one fails there).
    """

    def __init__(self, *args: Any, redis_url: str, standby_stop: threading.Event,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.redis_url = redis_url
        self.standby_stop = standby_stop  # set on SIGTERM: the standby's leaders leave too
        self.service_pid = os.getpid()

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.service_pid:  # a horse, before setup_work_horse_signals
            jobs.leave.set()
            return
        name = signal_name(signum)
        deadline = threading.Timer(SHUTDOWN_DEADLINE_S, self._leave, args=(
            f"{name}: not done after {SHUTDOWN_DEADLINE_S:.0f}s; {WITHOUT_COMMIT}",))
        deadline.daemon = True
        deadline.start()
        error = redis_error(self.redis_url, PING_TIMEOUT_S)
        if error is not None:
            self._leave(f"{name}: Redis unreachable ({error}); {WITHOUT_COMMIT}")
        log.info("%s: %s", name, "the job commits its batch and releases the run's lease; "
                 "another aggregator takes the run over" if self.horse_pid
                 else "no job running; leaving")
        self.standby_stop.set()
        try:
            super().request_stop(signum, frame)  # rq's warm shutdown
        except TRANSIENT_ERRORS as e:
            self._leave(f"{name}: Redis unreachable ({e}); {WITHOUT_COMMIT}")

    def handle_warm_shutdown_request(self) -> None:
        self._tell_horse_to_leave()

    def fork_work_horse(self, job: Job, queue: Any) -> None:
        super().fork_work_horse(job, queue)  # the horse never returns from it
        if self._stop_requested:  # SIGTERM came while the job was being dequeued
            self._tell_horse_to_leave()

    def setup_work_horse_signals(self) -> None:
        """In the horse, first thing: die with the service; SIGTERM asks the job to leave
        (without a moment of rq's SIG_DFL, which would kill it before its commit)."""
        die_with_parent(self.service_pid)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as rq: Ctrl-C is the service's
        jobs.leave_on_sigterm()

    def maintain_heartbeats(self, job: Job, execution: Execution) -> None:
        """rq's heartbeats while the horse works; an outage is waited out, not fatal."""
        try:
            super().maintain_heartbeats(job, execution)
        except TRANSIENT_ERRORS as e:
            log.warning("aggregator service: Redis unreachable (%s); rq's heartbeat for "
                        "job %s waits for it", e, job.id)

    def teardown(self) -> None:
        try:
            super().teardown()
        except TRANSIENT_ERRORS as e:
            log.warning("aggregator service: Redis unreachable (%s); rq's record of this "
                        "worker expires by itself", e)

    def _tell_horse_to_leave(self) -> None:
        if self.horse_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.horse_pid, signal.SIGTERM)

    def _leave(self, reason: str) -> NoReturn:
        """Kill the horse, say why in one line, and exit now, whatever any thread is
        waiting for: nothing is left to commit (Redis is gone, or the deadline passed)."""
        horse = self.horse_pid
        if horse:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(horse, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(horse, 0)
        log.warning("%s", reason)
        logging.disable(logging.CRITICAL)  # the reason is the last line
        os._exit(0)


def _leave_before_work(signum: int, frame: FrameType | None) -> NoReturn:
    """SIGTERM or SIGINT before rq's worker takes over the signals: nothing to hand over."""
    log.info("%s: no job running; leaving", signal_name(signum))
    raise SystemExit(0)


def serve(settings: AggregatorServiceSettings) -> None:
    logs.configure(settings.log_level, settings.log_format)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _leave_before_work)
    start_heartbeat(settings.heartbeat_file)
    with _metrics(settings.metrics_port) as observer:
        jobs.observer = observer  # rq's work horses are forked from here: they inherit it
        _work(settings, observer)


def _work(settings: AggregatorServiceSettings, observer: AggregatorObserver) -> None:
    # rq works on the queue's Redis; a job reaches the runs through jobs.runs_url.
    queue_url = settings.queue_url or settings.redis_url
    jobs.runs_url = settings.redis_url if settings.queue_url else None
    client = connect(queue_url, wait_s=float("inf"))
    stop = threading.Event()
    standby = threading.Thread(target=watch_orphans, args=(settings, stop, observer),
                               name="standby", daemon=True)
    standby.start()
    name = f"gemq-aggregator-{socket.gethostname()}-{os.getpid()}"
    log.info("aggregator service %s: waiting for jobs on %r at %s (runs at %s)", name,
             settings.aggregator_queue, redact(queue_url), redact(settings.redis_url))
    worker = AggregatorWorker([queue(client, settings.aggregator_queue)], connection=client,
                              name=name, serializer=JSONSerializer,
                              redis_url=queue_url, standby_stop=stop)
    try:
        worker.work(with_scheduler=False, logging_level=settings.log_level)
    finally:
        stop.set()
        standby.join(SHUTDOWN_DEADLINE_S)  # its leaders commit and release their leases
        client.close()


@contextlib.contextmanager
def _metrics(port: int | None) -> Iterator[AggregatorObserver]:
    """The service's /metrics on ``port`` (none without one), and the observer whose
    histograms it serves, summed over this process and its work horses."""
    if port is None:
        yield SILENT_AGGREGATOR
        return
    directory = tempfile.mkdtemp(prefix="gemq-metrics-")
    try:
        # Read by prometheus_client when first imported, just below: every process of the
        # service then keeps its metric values in a file of its own in the directory.
        os.environ[MULTIPROCESS_DIR_VARIABLE] = directory
        from . import telemetry

        observer = telemetry.serve_aggregator_metrics(port)
        log.info("aggregator metrics on http://%s:%d/metrics", telemetry.LISTEN_ADDRESS, port)
        yield observer
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    serve(load(AggregatorServiceSettings))


if __name__ == "__main__":
    main()
