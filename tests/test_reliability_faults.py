"""Faults found by probing gemq from outside, round two: every one ends cleanly, nothing is
left running, nothing hangs (docs/reliability.md). Real processes, Redis and signals."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from gemq.aggregation.aggregator import READ_BUDGET_BYTES, Leader
from gemq.aggregation.leadership import Leadership
from gemq.aggregation.rejections import LOGGED_PAIRS, TOO_STALE
from gemq.aggregation.window import UNKNOWN_WORKER
from gemq.config import RunConfig
from gemq.errors import PublishRefused
from gemq.layout import ParamLayout
from gemq.running.embedded import EmbeddedRedis
from gemq.running.runs import create_run
from gemq.state.connection import connect
from gemq.state.store import RunState, RunStore
from gemq.wire import codec
from tests.helpers import (
    SMALL_LAYOUT,
    GemqProcess,
    gradient_message,
    session,
    small_run,
    wait_for,
)

#: The largest stream entry id there is: nothing can be added after it.
LAST_POSSIBLE_ID = "18446744073709551615-18446744073709551615"

# A model whose gradients are always far beyond codec.MAX_ABS_GRADIENT: every gradient is
# rejected as out_of_range, as with a logits model trained on NLL once its weights grow.
EXPLODING = """
import torch

class Exploding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x):
        return torch.log_softmax(self.linear(x.flatten(1)) * 1e15, dim=1)

def net():
    return Exploding()
"""


def _training(process: GemqProcess) -> bool:
    names = " ".join(session(process.process.pid))
    return "redis-server" in names and names.count("python") >= 3


# --- 1. gemq run ends with everything it started, whatever ends it ---------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_signalled_gemq_run_leaves_nothing_running(tmp_path: Path, signum: int) -> None:
    process = GemqProcess("run", "--model", "mlp", "--dataset", "digits", "--workers", "2",
                          "--steps", "100000", "--no-progress", "--out", str(tmp_path))
    try:
        wait_for(lambda: _training(process), timeout_s=90, what="redis, aggregator, workers")
        time.sleep(2)  # well into training
        process.send_signal(signum)
        code = process.wait(timeout=30)
        wait_for(lambda: not session(process.process.pid), timeout_s=15,
                 what=f"every process of the run to end: {session(process.process.pid)}")
        if signum != signal.SIGKILL:
            assert code == 128 + signum, process.output()
            name = signal.Signals(signum).name
            assert f"gemq: stopped by {name}" in process.output()
            assert "Traceback" not in process.output()
    finally:
        process.stop()


# --- 2. a run that cannot make progress fails, with the reason ---------------------------


@pytest.mark.slow
def test_a_run_that_rejects_everything_fails_with_its_reason(
        tmp_path: Path, redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    (tmp_path / "exploding.py").write_text(EXPLODING)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "gemq", "run", "--model", "exploding:net", "--dataset",
         "digits", "--workers", "2", "--steps", "100000", "--run", "explodes",
         "--redis-url", redis_server.url, "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - started < 180
    last = out.stderr.strip().splitlines()[-1]
    # At least the limit: the count is judged once per read, after the read's entries.
    assert re.match(r"gemq: error: run explodes failed: (\d+) gradients in a row were "
                    r"rejected, \1 of them as out_of_range: gradient elements beyond 1e12",
                    last), last
    assert int(last.split()[5]) >= 1000
    assert "Traceback" not in out.stderr
    assert "rejected=" in out.stderr  # the progress bar showed them as they came
    store = RunStore(redis_client, "explodes")
    status = store.status()
    assert status["state"] == RunState.FAILED and "out_of_range" in status["error"]
    counters = store.counters()
    assert "applied" not in counters and counters["rejected:out_of_range"] >= 1000
    assert counters["published"] == (counters["rejected:out_of_range"] + counters.get("unused", 0)
                                      + store.unconsumed())


def test_stalls_are_judged_on_rejections_in_a_row_and_on_time() -> None:
    from gemq.aggregation.rejections import StallWatch

    watch = StallWatch(max_in_a_row=3, timeout_s=0.2)
    assert watch.stalled() is None  # nothing arrived: waiting, not stalled
    watch.rejected(TOO_STALE)
    watch.rejected(codec.NON_FINITE)
    watch.applied()
    watch.rejected(codec.NON_FINITE)
    watch.rejected(codec.NON_FINITE)
    assert watch.stalled() is None
    watch.rejected(TOO_STALE)
    message = watch.stalled()
    assert message is not None and message.startswith(
        "3 gradients in a row were rejected, 2 of them as non_finite: NaN or infinite")
    slow = StallWatch(max_in_a_row=10**6, timeout_s=0.2)
    slow.rejected(codec.WRONG_LAYOUT)
    assert slow.stalled() is None
    time.sleep(0.25)
    assert slow.stalled() is None  # one rejection, then silence: waiting, not stalled
    slow.rejected(codec.WRONG_LAYOUT)
    assert (slow.stalled() or "").startswith("no update was applied for 0s while 2 gradients")


# --- 4. a stream that refuses gradients: no lost count, no dead worker -------------------


def test_a_refused_gradient_is_not_counted(redis_client: redis.Redis) -> None:
    store = small_run(redis_client)
    gradient = np.ones(SMALL_LAYOUT.size, np.float32)
    store.publish_gradient("w1", gradient_message(store, "w1", gradient))
    redis_client.xadd(store.keys.gradients, {"w": "w1", "m": b"x"}, id=LAST_POSSIBLE_ID)
    with pytest.raises(PublishRefused, match="exhausted the last possible ID"):
        store.publish_gradient("w1", gradient_message(store, "w1", gradient))
    with pytest.raises(PublishRefused):
        store.publish_and_view("w1", gradient_message(store, "w1", gradient))
    assert store.counters() == {"published": 1}
    assert store.worker_states()["w1"]["steps"] == "1"


@pytest.mark.slow
def test_workers_survive_a_stream_that_refuses_them_and_fail_the_run(
        redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    config = RunConfig(run_id="exhausted", model="logreg", dataset="digits", batch_size=16,
                       budget_updates=10**6, stall_timeout_s=3)
    store = create_run(redis_client, config)
    url = redis_server.url
    aggregator = GemqProcess("aggregator", "--run", "exhausted", "--redis-url", url)
    workers = GemqProcess("worker", "--run", "exhausted", "--redis-url", url, "--workers", "2")
    try:
        wait_for(lambda: store.counters().get("applied", 0) >= 20, timeout_s=90,
                 what="training")
        redis_client.xadd(store.keys.gradients, {"w": "intruder", "m": b"x"},
                          id=LAST_POSSIBLE_ID)
        assert workers.wait(timeout=60) == 0, workers.output()
        assert aggregator.wait(timeout=30) == 0, aggregator.output()
        status = store.status()
        assert status["state"] == RunState.FAILED, status
        assert status["error"].startswith("workers could not publish for 3s: Redis refused "
                                          "the gradient: ")
        assert "exhausted the last possible ID" in status["error"]
        assert "Traceback" not in workers.output() + aggregator.output()
        counters = store.counters()
        assert counters["rejected:malformed"] == 1  # the intruder's entry, not published
        rejected = sum(v for k, v in counters.items() if k.startswith("rejected:"))
        assert counters["applied"] == store.head().version
        assert counters["published"] + 1 == (counters["applied"] + rejected
                                             + counters.get("unused", 0))
    finally:
        aggregator.stop()
        workers.stop()


# --- 5. no entry without a valid sender touches the parameters ---------------------------


@pytest.mark.parametrize("sender", [None, b"", b"not valid!", b"\xff\xfe", b"w2"],
                         ids=["missing", "empty", "invalid", "not-utf8", "not-the-header"])
def test_entries_without_a_valid_sender_are_rejected(redis_client: redis.Redis,
                                                     sender: bytes | None) -> None:
    store = small_run(redis_client)
    store.heartbeat("w1")  # a registered worker, whose name the entry carries
    fields = {"m": gradient_message(store, "w1", np.ones(SMALL_LAYOUT.size, np.float32))}
    if sender is not None:
        fields["w"] = sender
    redis_client.xadd(store.keys.gradients, fields)
    leader, before = _lead(store)
    assert leader.updates == 0
    np.testing.assert_array_equal(leader.theta, before)
    assert store.counters() == {"rejected:bad_sender": 1}


def test_a_sender_field_of_megabytes_is_rejected(redis_server: EmbeddedRedis) -> None:
    """gemq's own client reads values of a megabyte or more as memoryviews
    (gemq/state/bulkreads.py): one in the sender field is refused like any other invalid sender."""
    client = connect(redis_server.url)
    try:
        client.flushall()
        store = small_run(client)
        store.heartbeat("w1")
        client.xadd(store.keys.gradients, {
            "m": gradient_message(store, "w1", np.ones(SMALL_LAYOUT.size, np.float32)),
            "w": b"w1" * (1 << 20)})
        leader, before = _lead(store)
        assert leader.updates == 0
        np.testing.assert_array_equal(leader.theta, before)
        assert store.counters() == {"rejected:bad_sender": 1}
    finally:
        client.close()


def test_gradients_from_unregistered_senders_are_rejected(redis_client: redis.Redis) -> None:
    store = small_run(redis_client)
    message = gradient_message(store, "stranger", np.ones(SMALL_LAYOUT.size, np.float32))
    redis_client.xadd(store.keys.gradients, {"w": "stranger", "m": message})
    leader, before = _lead(store)
    np.testing.assert_array_equal(leader.theta, before)
    assert store.counters() == {"rejected:unknown_sender": 1}
    assert store.worker_states() == {}


def _lead(store: RunStore) -> tuple[Leader, np.ndarray]:
    """One window of a leader over everything in the stream, committed."""
    leader = Leader(store, store.config(), store.layout())
    before = leader.theta.copy()
    assert Leadership(store, "t", 5000).acquire()
    entries = Leadership(store, "t", 5000).read(10_000).entries
    from gemq.aggregation.aggregator import _field, _sender

    plan = leader.process([(i, _field(f, b"m"), _sender(f)) for i, f in entries])
    Leadership(store, "t", 5000).commit(plan, leader.theta)
    return leader, before


# --- 6. junk senders do not grow state or logs -------------------------------------------


def test_junk_from_many_senders_leaves_no_state_and_few_log_lines(
        redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    store = small_run(redis_client)
    store.heartbeat("w1")
    pipe = redis_client.pipeline(transaction=False)
    for i in range(3000):
        pipe.xadd(store.keys.gradients, {"w": f"junk-{i}", "m": b"\x93garbage"})
    pipe.execute()
    keys_before = set(redis_client.keys("*"))
    with caplog.at_level(logging.WARNING, logger="gemq.aggregation.rejections"):
        _lead(store)
    assert store.counters() == {"rejected:malformed": 3000}
    created = {k.decode() for k in set(redis_client.keys("*")) - keys_before}
    # The run's counters, the test leader's lease, and one hash for every unknown sender.
    assert created == {store.keys.counters, store.keys.lease,
                       store.keys.worker(UNKNOWN_WORKER)}, created
    assert store.worker_count() == 1
    assert store.worker_states(limit=10).keys() == {"w1"}
    assert len(caplog.records) <= LOGGED_PAIRS + 1


@pytest.mark.parametrize("sender", ["junk", "w1"], ids=["unregistered", "the-runs-worker"])
def test_only_the_runs_own_workers_can_stall_it(redis_client: redis.Redis,
                                                sender: str) -> None:
    """1,100 junk entries in a row (more than max_rejected_in_a_row) once failed a run whose
    real workers were healthy. From senders that never registered they are counted, not
    judged; from the run's own worker they are a stall."""
    store = small_run(redis_client, max_rejected_in_a_row=1000)
    store.heartbeat("w1")  # registered
    pipe = redis_client.pipeline(transaction=False)
    for i in range(1100):
        name = f"j{i}" if sender == "junk" else sender
        pipe.xadd(store.keys.gradients, {"w": name, "m": b"\x01"})
    pipe.execute()
    leader, _ = _lead(store)
    assert store.counters() == {"rejected:malformed": 1100}
    stalled = leader.stall.stalled()
    if sender == "junk":
        assert stalled is None
    else:
        assert stalled is not None and stalled.startswith("1100 gradients in a row")


def test_worker_listings_are_bounded(redis_client: redis.Redis) -> None:
    store = small_run(redis_client)
    for i in range(300):
        store.heartbeat(f"w{i}")
    assert store.worker_count() == 300
    listed = store.worker_states()
    assert len(listed) == 200 and "w299" in listed and "w0" not in listed  # newest first


# --- 7. what one read brings in is bounded by bytes --------------------------------------


def test_reads_of_large_gradients_take_fewer_entries(redis_client: redis.Redis) -> None:
    big = ParamLayout.from_shapes([("w", (4_000_000,))])  # 16 MB per gradient
    store = RunStore(redis_client, "big")
    store.create(RunConfig(run_id="big", read_batch=32), big, np.zeros(big.size, np.float32))
    leader = Leader(store, store.config(), store.layout())
    assert leader.read_count * leader.expected.byte_limit <= READ_BUDGET_BYTES
    assert leader.read_count == 4
    assert Leader(small_run(redis_client), RunConfig(run_id="t1"), SMALL_LAYOUT).read_count == 32


def test_a_local_runs_redis_refuses_values_larger_than_the_run_needs(
        redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    from gemq.running.local import refuse_oversized_values

    store = small_run(redis_client)
    refuse_oversized_values(redis_client, store, store.config())
    with pytest.raises(redis.RedisError):
        redis_client.xadd(store.keys.gradients, {"w": "w1", "m": b"\0" * (3 << 20)})
    with redis.Redis.from_url(redis_server.url) as fresh:
        assert fresh.xlen(store.keys.gradients) == 0
        fresh.xadd(store.keys.gradients, {"w": "w1", "m": b"\0" * 1000})  # a legal size
