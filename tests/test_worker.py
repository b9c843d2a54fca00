"""Workers against a real Redis: backpressure, threads, heartbeats, layout checks."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis

from gemq.aggregation.aggregator import Aggregator, AggregatorOptions, Leader, lead_shards
from gemq.config import RunConfig
from gemq.errors import GemqError
from gemq.running.runs import create_run
from gemq.state.store import RunState, RunStore
from gemq.training.worker import WorkerOptions, run_workers
from gemq.wire import codec
from tests.helpers import wait_for

TINY = {"model": "logreg", "dataset": "digits", "batch_size": 16}


def tiny_run(client: redis.Redis, run_id: str = "wk", **settings: object) -> RunStore:
    return create_run(client, RunConfig.from_dict({"run_id": run_id, **TINY, **settings}))


def start_workers(store: RunStore, ids: list[str]) -> tuple[threading.Thread,
                                                             threading.Event, dict[str, int]]:
    shutdown = threading.Event()
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.update(
        run_workers(store, ids, WorkerOptions(heartbeat_s=0.1), shutdown)), daemon=True)
    thread.start()
    return thread, shutdown, result


def test_workers_wait_while_the_stream_is_full(redis_client: redis.Redis) -> None:
    store = tiny_run(redis_client, max_pending=5)
    store.set_status(state=RunState.RUNNING)  # as if an aggregator ran, but none consumes
    thread, shutdown, result = start_workers(store, ["a", "b"])
    wait_for(lambda: redis_client.xlen(store.keys.gradients) >= 5, what="stream fills")
    time.sleep(0.5)
    length = redis_client.xlen(store.keys.gradients)
    beats = {w: store.worker_states()[w]["heartbeat_ms"] for w in ("a", "b")}
    time.sleep(0.5)
    shutdown.set()
    thread.join(10)
    # each worker may have checked the bound just before the other's last XADD
    assert 5 <= length <= 6
    assert redis_client.xlen(store.keys.gradients) == length
    assert sum(result.values()) == length
    later = store.worker_states()
    assert all(later[w]["heartbeat_ms"] > beats[w] for w in beats)  # waiting, yet alive


@pytest.mark.parametrize("shards", [1, 2])
def test_a_run_with_max_pending_1_trains_to_its_budget(redis_client: redis.Redis,
                                                       shards: int) -> None:
    """Room for one gradient per shard: a commit leaves no applied entry in the stream, so
    the workers find room again after every update."""
    store = tiny_run(redis_client, f"mp1-{shards}", budget_updates=30, max_pending=1,
                     shards=shards)
    agg_shutdown = threading.Event()
    agg = threading.Thread(target=lambda: lead_shards(
        store.shards(), AggregatorOptions(lease_ms=2000, idle_block_ms=50), agg_shutdown),
        daemon=True)
    agg.start()
    thread, shutdown, result = start_workers(store, ["a", "b"])
    try:
        thread.join(60)
        agg.join(30)
    finally:
        shutdown.set()
        agg_shutdown.set()
    assert [s.counters().get("applied") for s in store.shards()] == [30] * shards
    assert store.state() == RunState.FINISHED
    assert sum(result.values()) >= 30


def test_workers_wait_for_the_aggregator_to_start(redis_client: redis.Redis) -> None:
    store = tiny_run(redis_client)
    thread, shutdown, result = start_workers(store, ["a"])
    # Proof that the worker is in its loop, not yet starting: it heartbeats while it waits
    # (every 0.1 s here); three different beats mean it has looked at the run many times.
    beats: set[str] = set()

    def beaten_thrice() -> bool:
        beat = store.worker_states().get("a", {}).get("heartbeat_ms")
        if beat is not None:
            beats.add(str(beat))
        return len(beats) >= 3

    wait_for(beaten_thrice, timeout_s=60, what="the waiting worker's heartbeats")
    assert thread.is_alive()
    assert redis_client.xlen(store.keys.gradients) == 0  # nothing computed on stale params
    shutdown.set()
    thread.join(10)
    assert result == {"a": 0}


def test_threads_in_one_process_train_together(redis_client: redis.Redis) -> None:
    store = tiny_run(redis_client, budget_updates=300)
    agg_shutdown = threading.Event()
    agg = threading.Thread(target=lambda: Aggregator(store, AggregatorOptions(lease_ms=2000))
                           .run(agg_shutdown), daemon=True)
    agg.start()
    thread, _, result = start_workers(store, [f"t{i}" for i in range(6)])
    thread.join(120)
    agg.join(30)
    assert set(result) == {f"t{i}" for i in range(6)}
    assert all(steps > 0 for steps in result.values())
    counters = store.counters()
    assert counters["applied"] == 300
    applied = {w: int(s.get("applied", 0)) for w, s in store.worker_states().items()}
    assert sum(applied.values()) == 300 and min(applied.values()) > 0


def test_a_model_that_does_not_match_the_run_is_refused(redis_client: redis.Redis) -> None:
    store = tiny_run(redis_client)
    redis_client.set(store.keys.config, store.config().replace(model="mlp").to_json())
    with pytest.raises(GemqError, match="does not match the parameter layout"):
        run_workers(store, ["a"], WorkerOptions(), threading.Event())


def test_silent_worker_loses_its_gem_state(redis_client: redis.Redis) -> None:
    store = tiny_run(redis_client, worker_timeout_s=0.3, budget_updates=10**6)
    leader = Leader(store, store.config(), store.layout())

    def message(worker: str) -> bytes:
        return codec.encode(run_id=store.run_id, worker_id=worker, param_version=0,
                            samples=16, loss=1.0, layout_id=store.layout().layout_id,
                            gradient=np.ones(store.layout().size, np.float32))

    for worker in ("quiet", "busy"):
        store.heartbeat(worker)  # registers it, as its first publication would
    leader.process([("1-0", message("quiet"), "quiet"), ("2-0", message("busy"), "busy")])
    assert set(leader.rule.workers) == {"quiet", "busy"}
    time.sleep(0.4)
    leader.process([("3-0", message("busy"), "busy")])
    assert leader.rule.workers == ["busy"]


def test_the_aggregator_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import gemq.aggregation.aggregator, gemq.cli\n"
            "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_worker_processes_do_not_import_the_aggregator_kernel() -> None:
    # A local worker process is spawned: it imports the `gemq` script again, so gemq.cli.
    # numba there would cost every worker process its import time and memory for nothing.
    code = ("import sys, gemq.cli, gemq.training.worker\n"
            "assert 'numba' not in sys.modules, 'numba was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_allocator_keeps_freed_megabyte_buffers() -> None:
    # glibc here: the thresholds are set, and a freed 8 MB buffer is reused, not unmapped.
    import resource

    from gemq.process import keep_freed_memory

    assert keep_freed_memory()
    assert keep_freed_memory()  # idempotent
    np.ones(1 << 21, np.float32)  # warm the heap up to the size used below
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        buffer = np.ones(1 << 21, np.float32)  # 8 MB, allocated and freed again
        del buffer
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 200


@pytest.mark.parametrize("shared", [True, False])
def test_workers_of_one_process_read_each_version_once_between_them(
        redis_client: redis.Redis, shared: bool) -> None:
    """Three workers, three published versions: with the process's reads shared, Redis
    serves three GETs of the parameters, not nine, and every model holds each version."""
    from gemq.training.data import load_dataset
    from gemq.training.shardset import SharedReads
    from gemq.training.worker import Worker

    store = tiny_run(redis_client, f"shared-{shared}", shards=2)
    data = load_dataset("digits")
    reads = SharedReads() if shared else None
    workers = [Worker(store, f"w{i}", store.config(), data, shared=reads) for i in range(3)]
    shards, plan = store.shards(), store.plan()
    gets = lambda: redis_client.info("commandstats").get("cmdstat_get", {}).get("calls", 0)  # noqa: E731
    before = gets()
    for version in range(3):
        state = np.full(plan.size, float(version + 1), np.float32)
        if version:  # version 0 is the run's initial state
            for shard, part in zip(shards, plan.shards, strict=True):
                shard.client.set(shard.keys.params(version), state[part.slice].tobytes())
                shard.client.hset(shard.keys.head, "version", version)
        for worker in workers:
            worker._load_newer({k: version for k in range(2)})
            assert worker.versions == [version, version]
            if version:
                assert all(np.all(p.detach().numpy() == version + 1)
                           for p in worker.net.model.parameters())
    # One pipeline per read: a GET per shard in it.
    assert gets() - before == (3 if shared else 9) * 2
