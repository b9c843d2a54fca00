"""The parts of rq's Worker that gemq relies on beyond rq's public API, checked against the
rq installed.

services/aggregator.py's AggregatorWorker needs more than rq's documented extension points:
SIGTERM must reach the work horse (so the job commits its batch and releases its lease),
the service must leave at once when Redis is gone, and a heartbeat or teardown that finds
Redis away must not end the service. So it overrides six Worker methods, reads two of the
Worker's attributes and relies on how rq forks its horse. rq changes such internals between
releases, so each one is named here with what AggregatorWorker expects of it, and the
heartbeat path is run for real through a Redis outage. A release that changes one fails
here, naming it, rather than in an aggregator service that dies at a job's first
heartbeat.

What these tests found of earlier releases, and why gemq needs rq 3.0 or later:
rq 2.x calls maintain_heartbeats(job), without the execution; more to the point, its
monitor_work_horse writes the job's working time to Redis before each heartbeat, outside any
override, so a Redis outage during a job ends the service. rq 1.16 has no rq.executions,
its pubsub thread dies with a traceback when Redis goes, and its horse leaves the service's
session (os.setsid).

On a failure: read rq's new code for the method named, adapt AggregatorWorker (or bound rq
in pyproject.toml below that release), then update the table here.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import rq
from rq import Worker
from rq.worker import signal_name

from gemq.running.embedded import EmbeddedRedis
from gemq.services.aggregator import AggregatorWorker
from tests.helpers import session, wait_for

RQ = f"rq {rq.__version__}"

#: Each Worker method AggregatorWorker overrides: its parameters (after self) in the rq it
#: was written against, and the method of rq's that calls it (or, for a signal handler,
#: installs it): where the override takes effect.
OVERRIDES: dict[str, tuple[tuple[str, ...], str]] = {
    "request_stop": (("signum", "frame"), "_install_signal_handlers"),  # SIGTERM's handler
    "handle_warm_shutdown_request": ((), "request_stop"),
    "fork_work_horse": (("job", "queue"), "execute_job"),
    "setup_work_horse_signals": ((), "main_work_horse"),
    "maintain_heartbeats": (("job", "execution"), "monitor_work_horse"),
    "teardown": ((), "work"),
}


def _parameters(function: Callable[..., object]) -> tuple[str, ...]:
    return tuple(name for name in inspect.signature(function).parameters if name != "self")


def _tree(function: Callable[..., object]) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _uses_of(function: Callable[..., object], name: str) -> Iterator[ast.Attribute | ast.Call]:
    """Each ``self.<name>`` in ``function``'s source: the call where it is called, else the
    attribute (a method handed on, as to signal.signal)."""
    nodes = list(ast.walk(_tree(function)))
    calls = {id(node.func): node for node in nodes if isinstance(node, ast.Call)}
    for node in nodes:
        if (isinstance(node, ast.Attribute) and node.attr == name
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            yield calls.get(id(node), node)


def _self_calls(function: Callable[..., object]) -> Iterator[tuple[str, ast.Call]]:
    for node in ast.walk(_tree(function)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            yield node.func.attr, node


def test_every_override_is_listed_here() -> None:
    overridden = {name for name in vars(AggregatorWorker)
                  if not name.startswith("__") and hasattr(Worker, name)}
    assert overridden == set(OVERRIDES), (
        "AggregatorWorker's overrides of rq's Worker and this module's OVERRIDES differ: "
        "list each override with the rq signature it was written against "
        f"(overridden: {sorted(overridden)})")


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_rq_has_each_overridden_method_as_expected(name: str) -> None:
    expected, _ = OVERRIDES[name]
    method = getattr(Worker, name, None)
    assert callable(method), (
        f"{RQ}: Worker.{name} is gone, so AggregatorWorker.{name} (services/aggregator.py) "
        "no longer takes effect")
    found = _parameters(method)
    assert found == expected, (
        f"{RQ}: Worker.{name}{inspect.signature(method)} takes {found}; AggregatorWorker."
        f"{name} was written against {expected}")


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_rq_still_uses_each_override_where_expected(name: str) -> None:
    """rq's caller of each overridden method still calls it (so the override runs), with
    arguments that gemq's override accepts."""
    _, caller = OVERRIDES[name]
    method = getattr(Worker, caller, None)
    assert callable(method), f"{RQ}: Worker.{caller}, which used Worker.{name}, is gone"
    uses = list(_uses_of(method, name))
    assert uses, (f"{RQ}: Worker.{caller} no longer uses self.{name}, so AggregatorWorker."
                  f"{name} may never run; find where rq does that job now")
    override = inspect.signature(getattr(AggregatorWorker, name))
    for use in uses:
        if not isinstance(use, ast.Call):
            continue
        if any(isinstance(a, ast.Starred) for a in use.args) or any(
                k.arg is None for k in use.keywords):
            continue  # *args or **kwargs: nothing to check statically
        try:
            override.bind(None, *use.args, **{k.arg: None for k in use.keywords if k.arg})
        except TypeError as e:
            raise AssertionError(
                f"{RQ}: Worker.{caller} calls {ast.unparse(use)}, which AggregatorWorker."
                f"{name}{override} does not accept ({e})") from None


def test_rq_sets_the_stop_flag_that_fork_work_horse_reads() -> None:
    """AggregatorWorker.fork_work_horse reads self._stop_requested: SIGTERM may come while
    a job is being dequeued, and the new horse must then be told to leave at once."""
    methods = [Worker.request_stop, *(getattr(Worker, callee) for callee, _ in
                                      _self_calls(Worker.request_stop)
                                      if callable(getattr(Worker, callee, None)))]
    sets = [node for method in methods for node in ast.walk(_tree(method))
            if isinstance(node, ast.Assign) and ast.unparse(node.value) == "True" and any(
                ast.unparse(t) == "self._stop_requested" for t in node.targets)]
    assert sets, (f"{RQ}: Worker.request_stop no longer sets self._stop_requested, which "
                  "AggregatorWorker.fork_work_horse reads")


def test_rq_puts_the_horse_in_a_process_group_of_its_own() -> None:
    """AggregatorWorker._leave kills the horse with os.killpg(horse_pid), so the horse must
    lead a process group; it must also stay in the service's session, where
    tests/test_aggregator_service.py looks for what a service leaves behind: os.setpgrp."""
    calls = {ast.unparse(node.func) for node in ast.walk(_tree(Worker.fork_work_horse))
             if isinstance(node, ast.Call)}
    assert "os.setpgrp" in calls and "os.setsid" not in calls, (
        f"{RQ}: Worker.fork_work_horse no longer puts the horse in a process group of its "
        f"own within the service's session (it calls {sorted(calls)}); "
        "AggregatorWorker._leave's os.killpg relies on that")


def test_signal_name_is_still_there() -> None:
    assert signal_name(signal.SIGTERM) == "SIGTERM", f"{RQ}: rq.worker.signal_name changed"


def test_the_worker_attributes_gemq_reads(redis_client: redis.Redis) -> None:
    """horse_pid (the service's SIGTERM handler) and _stop_requested (fork_work_horse), as
    an idle worker has them."""
    worker = Worker(["q"], connection=redis_client)
    assert isinstance(inspect.getattr_static(Worker, "horse_pid"), property), RQ
    assert worker.horse_pid == 0, f"{RQ}: an idle worker's horse_pid is {worker.horse_pid!r}"
    assert worker._stop_requested is False, f"{RQ}: Worker._stop_requested is gone"


#: A worker as the aggregator service builds it, but with rq's job monitoring (a heartbeat)
#: every second rather than every DEFAULT_JOB_MONITORING_INTERVAL, on a job that sleeps:
#: each heartbeat rq sends goes through the override.
HEARTBEATS = """
import logging, sys, threading
from rq.serializers import JSONSerializer
from gemq.services.aggregator import AggregatorWorker
from gemq.services.jobs import queue
from gemq.state.connection import connect

class Probe(AggregatorWorker):
    def maintain_heartbeats(self, job, *args, **kwargs):
        super().maintain_heartbeats(job, *args, **kwargs)
        print("heartbeat handled", flush=True)

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
client = connect(sys.argv[1])
jobs = queue(client, "heartbeats")
jobs.enqueue("time.sleep", 120)
Probe([jobs], connection=client, serializer=JSONSerializer, redis_url=sys.argv[1],
      standby_stop=threading.Event(), job_monitoring_interval=1).work(burst=True)
"""


@pytest.mark.slow
def test_heartbeats_go_through_the_override_and_outlast_an_outage(
        redis_server: EmbeddedRedis) -> None:
    """rq calls maintain_heartbeats as the override expects, and a heartbeat that finds
    Redis gone costs a warning, not the service (rq would end the worker)."""
    with tempfile.NamedTemporaryFile(prefix="gemq-heartbeats-", suffix=".log") as log:
        process = subprocess.Popen([sys.executable, "-c", HEARTBEATS, redis_server.url],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)

        def output() -> str:
            return Path(log.name).read_text(errors="replace")

        def until(what: str, predicate: Callable[[str], bool]) -> None:
            """Wait for ``predicate`` of the output, or for the worker to give up."""
            wait_for(lambda: predicate(output()) or "unhandled exception" in output()
                     or process.poll() is not None, timeout_s=60, what=what)
            assert "unhandled exception" not in output(), output()
            assert process.poll() is None, output()

        try:
            until("a heartbeat", lambda text: "heartbeat handled" in text)
            redis_server.kill()
            until("a heartbeat without Redis", lambda text: "rq's heartbeat for job" in text)
            before = output().count("heartbeat handled")
            until("the next heartbeat",
                  lambda text: text.count("heartbeat handled") > before)
        finally:
            for line in session(process.pid):  # the worker and its horse
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[0]), signal.SIGKILL)
            process.wait()
