"""The rq job layer: a run's aggregation is one job per shard on the aggregator queue.

Jobs are serialised as JSON (no pickle). The job function imports numpy only, so the
aggregator service needs no torch. It runs in an rq work horse; the service forwards its
SIGTERM there, and the job then commits its batch, releases the run's lease and returns.
"""

from __future__ import annotations

import logging
import signal
import threading

import redis
from rq import Queue, Worker, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from gemq import logs
from gemq.aggregation.aggregator import Aggregator, AggregatorOptions
from gemq.state.connection import connect
from gemq.state.retention import release_if_ended
from gemq.state.store import RunState, RunStore
from gemq.telemetry import SILENT_AGGREGATOR, AggregatorObserver

log = logging.getLogger(__name__)

#: Set in a work horse that is asked to leave (SIGTERM): the job commits its batch, releases
#: the run's lease and returns. One job per horse, so one event per process.
leave = threading.Event()
#: The URL of the Redis holding the runs, where it is not the queue's (GEMQ_QUEUE_URL set):
#: set by the aggregator service before it forks its work horses, never stored in a job.
runs_url: str | None = None
#: Told of every batch the jobs of this process apply and commit: the aggregator service
#: sets it before rq forks the work horses, which inherit it.
observer: AggregatorObserver = SILENT_AGGREGATOR


def leave_on_sigterm() -> None:
    """In a work horse: SIGTERM sets ``leave`` (rq's default would kill the horse)."""
    signal.signal(signal.SIGTERM, lambda *_: leave.set())


def queue(client: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=client, serializer=JSONSerializer)


def enqueue_aggregation(store: RunStore, jobs: redis.Redis, queue_name: str,
                        lease_ms: int = 5000) -> str:
    """Enqueue the aggregation of ``store``'s run, one job per shard, on the rq queue
    ``queue_name`` in the Redis ``jobs`` (the runs' own, or the plain Redis beside a Redis
    Cluster: GEMQ_QUEUE_URL); record shard 0's job id in the run's status (the job the API
    reports) and return it."""
    run_id = store.run_id
    rq_queue = queue(jobs, queue_name)
    shards = range(store.config().shards)
    names = [run_id if shard == 0 else f"{run_id}-shard-{shard}" for shard in shards]
    job_ids = [f"gemq-aggregate-{name}" for name in names]
    # First the run, atomically: a start racing another start or a deletion either claims
    # it or is refused, and no job is enqueued for a run that is gone or taken.
    store.claim_start(job_ids)
    for shard, job_id in zip(shards, job_ids, strict=True):
        rq_queue.enqueue(
            aggregate, run_id, lease_ms, shard, job_id=job_id,
            job_timeout=-1, result_ttl=7 * 24 * 3600, failure_ttl=7 * 24 * 3600,
            description=f"aggregate run {run_id}" + (f" shard {shard}" if shard else ""))
    return job_ids[0]


def job_state(client: redis.Redis, job_id: str | None) -> dict[str, str | None]:
    """{"id", "state", "error"} of an aggregation job, as rq sees it."""
    if not job_id:
        return {"id": None, "state": None, "error": None}
    try:
        job = Job.fetch(job_id, connection=client, serializer=JSONSerializer)
    except Exception:  # rq raises NoSuchJobError, or others on a half-expired job
        return {"id": job_id, "state": "expired", "error": None}
    status = job.get_status(refresh=True)
    error = None
    if status is not None and status.value == "failed":
        latest = job.latest_result()
        error = (latest.exc_string or "").strip().splitlines()[-1:] if latest else None
    return {"id": job_id, "state": status.value if status else None,
            "error": error[0] if error else None}


def job_listeners(client: redis.Redis, job_id: str | None) -> int | None:
    """How many rq workers (aggregator services) take jobs from the queue of ``job_id``;
    None where there is no such job."""
    if not job_id:
        return None
    try:
        job = Job.fetch(job_id, connection=client, serializer=JSONSerializer)
    except Exception:  # as in job_state: gone, or half-expired
        return None
    return Worker.count(connection=client, queue=queue(client, job.origin))


def forget_job(client: redis.Redis, job_id: str | None) -> None:
    """Delete a deleted run's aggregation job from rq: its record, and its place in the
    queue if it was still waiting there (a job that runs anyway finds no run and fails)."""
    if not job_id:
        return
    try:
        Job.fetch(job_id, connection=client, serializer=JSONSerializer).delete()
    except NoSuchJobError:
        return  # rq dropped it already (its result_ttl passed)
    except Exception as e:  # a half-expired record: it expires by itself, the run is gone
        log.warning("could not delete rq job %s: %s", job_id, e)


def aggregate(run_id: str, lease_ms: int = 5000, shard: int = 0) -> str:
    """The job: lead one shard's aggregation until its budget is spent, the run is stopped
    or fails."""
    job = get_current_job()
    assert job is not None, "aggregate() runs inside an rq job"
    leave_on_sigterm()  # installed by the service's worker already; here for any other rq worker
    client = connect(runs_url) if runs_url else job.connection
    try:
        return _lead(RunStore(client, run_id, shard), lease_ms, job.id)
    finally:
        if client is not job.connection:
            client.close()


def _lead(store: RunStore, lease_ms: int, job_id: str) -> str:
    try:
        with logs.log_context(run=store.run_id):
            final = Aggregator(store, AggregatorOptions(lease_ms=lease_ms,
                                                        observer=observer)).run(leave)
    except Exception as e:
        if store.exists():  # a run deleted meanwhile (gemq rm --force) stays deleted
            store.fail(f"{type(e).__name__}: {e}")
        raise
    release_if_ended(store, final)
    if final == "shutdown" and store.state() == RunState.CREATED:
        # Asked to leave before it ever led: only a running run without a lease is taken
        # over by the standbys, so mark it running rather than leave it waiting forever.
        store.mark_running(f"none (job {job_id} left before leading)")
    return final
