"""The aggregator service on SIGTERM: it leaves within the pod's grace period whether or not
Redis answers, says why in one line, and leaves no rq work horse behind.

Real redis-server, real service processes, real signals. The work horse puts itself in a
process group of its own (rq), so "nothing left behind" is checked over the service's
session: GemqProcess starts each service as a session leader, and the horse stays in it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from gemq.config import RunConfig
from gemq.running.embedded import EmbeddedRedis
from gemq.running.runs import create_run
from gemq.services.aggregator import SHUTDOWN_DEADLINE_S
from gemq.services.jobs import enqueue_aggregation
from gemq.state.store import RunState, RunStore
from tests.helpers import GemqProcess, session, wait_for

ROOT = Path(__file__).resolve().parent.parent
#: Seconds from SIGTERM to exit these tests allow: well inside the manifest's grace period.
EXIT_BOUND_S = 10.0
LEASE_MS = "1000"
QUEUE = "gemq-aggregator"


def _service(url: str) -> GemqProcess:
    service = GemqProcess("aggregator", "--serve", "--redis-url", url, "--lease-ms", LEASE_MS)
    wait_for(lambda: "waiting for jobs" in service.output(), timeout_s=30, what="the service")
    return service


def _leader_pid(store: RunStore) -> int | None:
    token = store.client.get(store.keys.lease)
    return int(token.decode().split(":")[1]) if token else None  # host:pid:random


def _horse_leading(client: redis.Redis, service: GemqProcess, run_id: str) -> RunStore:
    """A run whose rq job the service took: its work horse holds the run's lease."""
    store = create_run(client, RunConfig(run_id=run_id, model="logreg", dataset="digits",
                                         batch_size=16, budget_updates=10**6))
    enqueue_aggregation(store, client, QUEUE, lease_ms=int(LEASE_MS))
    wait_for(lambda: _leader_pid(store) is not None, timeout_s=30, what="a leading horse")
    assert _leader_pid(store) != service.process.pid  # a work horse, not the service itself
    return store


def _sigterm(service: GemqProcess) -> tuple[int | None, float]:
    """SIGTERM; the exit code (None: still running 30 s later) and the seconds it took."""
    started = time.monotonic()
    service.send_signal(signal.SIGTERM)
    try:
        code: int | None = service.wait(30)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - started


def test_the_shutdown_deadline_fits_the_grace_period() -> None:
    manifest = yaml.safe_load_all((ROOT / "k8s/base/aggregator.yaml").read_text())
    deployment = next(o for o in manifest if o and o["kind"] == "Deployment")
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert SHUTDOWN_DEADLINE_S + 1 <= EXIT_BOUND_S < grace


@pytest.mark.slow
@pytest.mark.parametrize("outage", ["killed", "frozen"])
def test_sigterm_while_redis_is_gone_leaves_at_once(redis_server: EmbeddedRedis,
                                                    redis_client: redis.Redis,
                                                    outage: str) -> None:
    """Killed: connections are refused. Frozen (SIGSTOP): they hang, as with a dead node."""
    service = _service(redis_server.url)
    assert redis_server.process is not None
    try:
        _horse_leading(redis_client, service, "gone")
        if outage == "killed":
            redis_server.kill()
        else:
            redis_server.process.send_signal(signal.SIGSTOP)
        time.sleep(1.5)  # the outage under way: the horse and rq retry and log
        code, seconds = _sigterm(service)
        left = session(service.process.pid)
        output = service.output()
    finally:
        if redis_server.process is not None:
            redis_server.process.send_signal(signal.SIGCONT)
        service.stop()
    print(f"{outage}: exit {code} after {seconds:.1f}s, {len(output.splitlines())} lines, "
          f"{output.count('Traceback')} tracebacks, {len(left)} left")
    assert code == 0 and seconds < EXIT_BOUND_S, (code, seconds, output)
    assert not left, left
    assert "Traceback" not in output, output
    last = output.splitlines()[-1]
    assert "SIGTERM: Redis unreachable" in last, output
    assert "leaving without a final commit" in last


@pytest.mark.slow
def test_sigterm_while_leading_commits_and_hands_the_run_over(redis_server: EmbeddedRedis,
                                                              redis_client: redis.Redis) -> None:
    url = redis_server.url
    service = _service(url)
    worker = successor = None
    try:
        store = _horse_leading(redis_client, service, "busy")
        worker = GemqProcess("worker", "--run", "busy", "--redis-url", url, "--worker-id", "w0")
        wait_for(lambda: store.counters().get("applied", 0) >= 50, timeout_s=60,
                 what="50 updates")
        code, seconds = _sigterm(service)
        left = session(service.process.pid)
        output = service.output()
        # The horse committed its batch and released the lease: the run waits, consistent.
        applied = store.counters()["applied"]
        assert store.head().version == applied
        assert not redis_client.exists(store.keys.lease)
        assert store.state() == RunState.RUNNING
        successor = _service(url)  # another replica, later, takes the run over
        wait_for(lambda: store.counters()["applied"] >= applied + 50, timeout_s=60,
                 what="the successor's updates")
        assert "taking it over" in successor.output()
    finally:
        for process in (worker, successor, service):
            if process is not None:
                process.stop()
    print(f"leading: exit {code} after {seconds:.1f}s, {len(output.splitlines())} lines, "
          f"{output.count('Traceback')} tracebacks, {len(left)} left")
    assert code == 0 and seconds < EXIT_BOUND_S, (code, seconds, output)
    assert not left, left
    assert "Traceback" not in output, output
    assert "SIGTERM: the job commits its batch and releases the run's lease" in output


@pytest.mark.slow
def test_sigterm_as_redis_freezes_leaves_within_the_deadline(redis_server: EmbeddedRedis,
                                                             redis_client: redis.Redis) -> None:
    """Redis answers the service's PING, then hangs (SIGSTOP) while the horse commits and
    rq writes its records: the deadline ends it."""
    service = _service(redis_server.url)
    assert redis_server.process is not None
    try:
        _horse_leading(redis_client, service, "freezing")
        time.sleep(0.5)
        started = time.monotonic()
        service.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        redis_server.process.send_signal(signal.SIGSTOP)
        code = service.wait(30)
        seconds = time.monotonic() - started
        left = session(service.process.pid)
        output = service.output()
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
        service.stop()
    print(f"freezing: exit {code} after {seconds:.1f}s, {len(output.splitlines())} lines, "
          f"{output.count('Traceback')} tracebacks, {len(left)} left")
    assert code == 0 and seconds < EXIT_BOUND_S, (code, seconds, output)
    assert not left, left
    assert "Traceback" not in output, output


@pytest.mark.slow
def test_sigterm_while_idle_leaves_cleanly(redis_server: EmbeddedRedis) -> None:
    service = _service(redis_server.url)
    try:
        code, seconds = _sigterm(service)
        output = service.output()
    finally:
        service.stop()
    assert code == 0 and seconds < EXIT_BOUND_S, (code, seconds, output)
    assert "Traceback" not in output, output
    assert "SIGTERM: no job running; leaving" in output


@pytest.mark.slow
def test_the_work_horse_dies_with_the_service(redis_server: EmbeddedRedis,
                                              redis_client: redis.Redis) -> None:
    """SIGKILL (the grace period over, the OOM killer): no signal handler runs, yet the
    horse goes too."""
    service = _service(redis_server.url)
    try:
        _horse_leading(redis_client, service, "killed")
        service.send_signal(signal.SIGKILL)
        service.wait(10)
        wait_for(lambda: not session(service.process.pid), timeout_s=5,
                 what="the horse to die with the service")
    finally:
        service.stop()
