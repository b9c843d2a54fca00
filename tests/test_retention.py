"""What an ended run keeps in Redis, deleting runs, and the retention policy
(gemq/state/retention.py), against a real redis-server."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
import redis
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from gemq.aggregation.aggregator import Aggregator, AggregatorOptions, aggregator_main
from gemq.aggregation.leadership import Leadership
from gemq.config import RunConfig
from gemq.errors import RunBusy, RunNotFound
from gemq.layout import ParamLayout
from gemq.records.summary import run_totals
from gemq.running.embedded import EmbeddedRedis
from gemq.services.jobs import enqueue_aggregation, queue
from gemq.state.keys import AGGREGATOR_GROUP, RUNS_INDEX, run_key_pattern
from gemq.state.retention import (
    RetentionPolicy,
    apply_retention,
    delete_run,
    release_if_ended,
    release_training_state,
)
from gemq.state.store import RunState, RunStore, now_ms
from gemq.wire import codec
from tests.helpers import GemqProcess, small_run

#: 65,792 floats: 257 KiB per parameter snapshot, enough for memory to be measured.
LAYOUT = ParamLayout.from_shapes([("w", (256, 256)), ("b", (256,))])
SNAPSHOT_BYTES = 4 * LAYOUT.size
FAST = AggregatorOptions(lease_ms=2000, idle_block_ms=50, standby_poll_s=0.05)


def new_run(client: redis.Redis, run_id: str, updates: int, **settings: object) -> RunStore:
    """A run over LAYOUT whose aggregator applies one gradient per commit (a snapshot per
    update), with ``updates`` gradients of worker w1 waiting in its stream."""
    config = RunConfig.from_dict({"run_id": run_id, "budget_updates": updates,
                                  "read_batch": 1, "lr": 0.01, **settings})
    store = RunStore(client, run_id)
    store.create(config, LAYOUT, np.zeros(LAYOUT.size, np.float32))
    for i in range(updates):
        publish(store, version=0, seed=i)
    return store


def publish(store: RunStore, version: int, seed: int = 0) -> None:
    gradient = np.random.default_rng(seed).standard_normal(LAYOUT.size).astype(np.float32)
    store.publish_gradient("w1", codec.encode(
        run_id=store.run_id, worker_id="w1", param_version=version, samples=8, loss=1.0,
        layout_id=LAYOUT.layout_id, gradient=gradient))


def aggregate(store: RunStore) -> str:
    """Lead the run to its end in this thread, as an aggregator process does."""
    return Aggregator(store, FAST).run()


def run_bytes(client: redis.Redis, run_id: str) -> int:
    """MEMORY USAGE summed over every key of the run."""
    return sum(client.memory_usage(key, samples=0) or 0  # type: ignore[misc]
               for key in client.scan_iter(match=run_key_pattern(run_id)))


def run_keys(client: redis.Redis, run_id: str) -> set[str]:
    return {k.decode() for k in client.scan_iter(match=run_key_pattern(run_id))}


def snapshot_memory(store: RunStore) -> int:
    """What Redis spends on the run's final snapshot: its bytes, rounded up to the
    allocator's size class."""
    usage = store.client.memory_usage(store.keys.params(store.head().version), samples=0)
    return int(usage)  # type: ignore[arg-type]


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])  # type: ignore[index]


# --- an ended run keeps its results -------------------------------------------------------

def test_an_ended_run_keeps_its_results_and_frees_its_training_state(
        redis_client: redis.Redis) -> None:
    store = new_run(redis_client, "ended", updates=20)
    assert aggregate(store) == RunState.FINISHED
    publish(store, version=20)  # a worker's last gradient, after the end: unused
    before, totals = run_bytes(redis_client, "ended"), run_totals(store)
    final_version, final = store.latest()
    assert len(store.kept_versions()) == 21 and store.checkpointed_moments()[1]

    release_if_ended(store, RunState.FINISHED)

    after = run_bytes(redis_client, "ended")
    # 21 snapshots, a moment and two gradients before; the final snapshot and small keys now.
    assert before > 22 * SNAPSHOT_BYTES
    assert after < snapshot_memory(store) + 16 * 1024, after
    assert store.kept_versions() == [final_version] == [20]
    np.testing.assert_array_equal(store.latest()[1], final)
    assert store.checkpointed_moments() == (-1, {})
    assert redis_client.xlen(store.keys.gradients) == 0
    assert redis_client.xinfo_groups(store.keys.gradients)[0]["name"] == AGGREGATOR_GROUP.encode()
    assert store.counters()["unused"] == 1
    assert run_totals(store) == totals  # the summary reads as before
    assert store.config().run_id == "ended" and store.layout() == LAYOUT
    assert len(store.metrics_since()) == 20 and store.worker_states()["w1"]["applied"] == "20"
    release_training_state(store)  # again: nothing changes
    assert run_totals(store) == totals and store.counters()["unused"] == 1


def test_gemq_aggregator_frees_the_run_it_ends(redis_server: EmbeddedRedis,
                                               redis_client: redis.Redis) -> None:
    baseline = used_memory(redis_client)
    store = new_run(redis_client, "cli", updates=30)
    process = GemqProcess("aggregator", "--run", "cli", "--redis-url", redis_server.url)
    try:
        assert process.wait(60) == 0, process.output()
    finally:
        process.stop()
    assert store.state() == RunState.FINISHED
    assert store.kept_versions() == [30]
    # Redis as a whole holds the run's final snapshot and little else: its 31 snapshots and
    # the GEM moment were 8.4 MB. (2 MiB of slack: Redis trims client buffers lazily.)
    assert used_memory(redis_client) - baseline < snapshot_memory(store) + 2 * 2**20


def test_a_run_that_has_not_ended_keeps_everything(redis_client: redis.Redis) -> None:
    store = new_run(redis_client, "young", updates=3)
    assert not release_training_state(store)
    store.mark_running("someone")
    release_if_ended(store, "shutdown")
    assert not release_training_state(store)
    assert redis_client.xlen(store.keys.gradients) == 3
    assert release_training_state(RunStore(redis_client, "nosuch")) is False


def fill_up(client: redis.Redis) -> None:
    """Set maxmemory to what Redis uses now: it then refuses writes (noeviction)."""
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", used_memory(client))
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("gemq:probe", b"x" * 100_000)


def test_a_full_redis_can_be_freed(redis_client: redis.Redis) -> None:
    """At maxmemory with noeviction (k8s/base), Redis refuses writes: releasing an ended
    run, and deleting one, must still work (they delete before they write)."""
    store = new_run(redis_client, "full", updates=10)
    assert aggregate(store) == RunState.FINISHED
    other = new_run(redis_client, "other", updates=10)
    assert aggregate(other) == RunState.FINISHED
    publish(store, version=10)
    fill_up(redis_client)
    assert release_training_state(store)
    assert store.kept_versions() == [10] and store.counters()["unused"] == 1
    fill_up(redis_client)
    assert delete_run(redis_client, "other").keys > 10
    redis_client.set("gemq:probe", b"x" * 100_000)  # taken again


# --- deleting runs --------------------------------------------------------------------------

def ended_run(client: redis.Redis, run_id: str, ended_ms: int | None = None,
              state: RunState = RunState.FINISHED) -> RunStore:
    store = small_run(client, run_id)
    store.set_status(state=state, ended_ms=ended_ms or now_ms())
    return store


def test_delete_removes_every_key_of_the_run_and_no_other(redis_client: redis.Redis) -> None:
    store = new_run(redis_client, "r1", updates=5)
    assert aggregate(store) == RunState.FINISHED
    neighbour = ended_run(redis_client, "r10")  # its id starts with the other's
    redis_client.set("gemq:{r1/1}:head", b"a shard's key")
    redis_client.set("gemq:{r1/1.3}:head", b"a shard's key, placed on a cluster's master")
    redis_client.set("gemq:{r1x/1}:head", b"another run's shard")
    deleted = delete_run(redis_client, "r1")
    assert deleted.keys >= 12 and deleted.job_id is None
    assert run_keys(redis_client, "r1") == set()
    assert [k.decode() for k in redis_client.scan_iter(match="*r1[}/]*")] == []
    assert redis_client.zscore(RUNS_INDEX, "r1") is None
    assert neighbour.state() == RunState.FINISHED and redis_client.exists("gemq:{r1x/1}:head")
    with pytest.raises(RunNotFound, match="no run 'r1'"):
        delete_run(redis_client, "r1")
    with pytest.raises(RunNotFound, match="not a valid run id"):
        delete_run(redis_client, "*")
    assert neighbour.state() == RunState.FINISHED


def test_delete_refuses_while_anything_may_write_to_the_run(redis_client: redis.Redis) -> None:
    queued = small_run(redis_client, "queued")
    queued.set_status(job_id="gemq-aggregate-queued")
    with pytest.raises(RunBusy, match="queued for an aggregator") as refused:
        delete_run(redis_client, "queued")
    assert refused.value.reason == "busy"
    running = small_run(redis_client, "running")
    running.mark_running("leader")
    with pytest.raises(RunBusy, match="'running' is running: stop it first"):
        delete_run(redis_client, "running")
    ending = ended_run(redis_client, "ending")
    assert Leadership(ending, "leader", 5000).acquire()  # its aggregator has not left yet
    with pytest.raises(RunBusy, match="held by an aggregator") as refused:
        delete_run(redis_client, "ending", force=True)
    assert refused.value.reason == "led"
    for store in (queued, running, ending):
        assert store.config().run_id == store.run_id
    assert delete_run(redis_client, small_run(redis_client, "never-started").run_id).keys > 5


def test_force_deletes_a_run_only_once_its_workers_are_gone(redis_client: redis.Redis) -> None:
    store = small_run(redis_client, "abandoned", worker_timeout_s=30)
    store.mark_running("a leader that died")
    store.heartbeat("w7")
    with pytest.raises(RunBusy, match="worker 'w7' was heard from") as refused:
        delete_run(redis_client, "abandoned", force=True)
    assert refused.value.reason == "workers"
    redis_client.zadd(store.keys.workers, {"w7": now_ms() - 31_000})  # silent for 31 s
    deleted = delete_run(redis_client, "abandoned", force=True)
    assert deleted.keys > 5 and run_keys(redis_client, "abandoned") == set()


def test_a_created_run_with_workers_attached_is_not_deleted_under_them(
        redis_client: redis.Redis) -> None:
    """Workers wait on a created run for its start; deleting it made them exit 1."""
    store = small_run(redis_client, "waiting", worker_timeout_s=30)
    store.heartbeat("w3")
    for force in (False, True):
        with pytest.raises(RunBusy, match="worker 'w3' was heard from") as refused:
            delete_run(redis_client, "waiting", force=force)
        assert refused.value.reason == "workers"
    assert store.config().run_id == "waiting"
    redis_client.zadd(store.keys.workers, {"w3": now_ms() - 31_000})  # gone for 31 s
    assert delete_run(redis_client, "waiting").keys > 5


def test_a_worker_frozen_past_the_deletion_makes_no_key_again(
        redis_client: redis.Redis) -> None:
    """Every write a worker makes, made after its run was deleted (as by a worker frozen
    through the deletion, SIGSTOP or a partition): none makes a key of the run again."""
    store = ended_run(redis_client, "thawed")
    store.heartbeat("w1")
    delete_run(redis_client, "thawed")
    with pytest.raises(RunNotFound):
        publish(store, version=0)
    store.heartbeat("w1")
    assert store.claim_evaluation(7) is False
    store.record_evaluation(70, 0.5, 0.9)
    assert store.fail("late") is False
    with pytest.raises(RunNotFound):
        store.conclude()
    assert run_keys(redis_client, "thawed") == set()


def test_keys_left_by_a_writer_after_the_deletion_are_removed_by_the_next(
        redis_client: redis.Redis) -> None:
    """An aggregator frozen past its lease and the deletion may still write a counter: the
    run is gone from the index, and `gemq rm` (delete_run) removes what is left."""
    ended_run(redis_client, "late")
    delete_run(redis_client, "late")
    redis_client.hincrby("gemq:{late}:counters", "rejected:stale", 1)
    redis_client.hset("gemq:{late}:status", "leader", "a frozen aggregator")
    assert delete_run(redis_client, "late").keys == 2
    assert run_keys(redis_client, "late") == set()
    with pytest.raises(RunNotFound, match="no run 'late' in Redis"):
        delete_run(redis_client, "late")


def test_a_deletion_cut_short_is_finished(redis_client: redis.Redis) -> None:
    store = ended_run(redis_client, "half")
    redis_client.delete(store.keys.status, store.keys.config)  # claimed, then the process died
    assert delete_run(redis_client, "half").keys >= 3
    assert run_keys(redis_client, "half") == set()
    assert redis_client.zscore(RUNS_INDEX, "half") is None


# --- retention --------------------------------------------------------------------------------

def test_the_policy_keeps_the_newest_and_the_young() -> None:
    day = 86_400_000
    ended = {"a": 1 * day, "b": 5 * day, "c": 3 * day, "d": 9 * day}
    assert RetentionPolicy(keep_runs=2).doomed(ended, 10 * day) == ["a", "c"]
    assert RetentionPolicy(keep_runs=0, keep_days=6).doomed(ended, 10 * day) == ["a", "c"]
    assert RetentionPolicy(keep_runs=3, keep_days=2).doomed(ended, 10 * day) == ["a", "c", "b"]
    assert RetentionPolicy(keep_runs=0, keep_days=0).doomed(ended, 10 * day) == []
    assert RetentionPolicy().keep_runs == 100


def test_retention_deletes_the_oldest_ended_runs_and_never_a_live_one(
        redis_client: redis.Redis) -> None:
    start = now_ms()
    for i in range(5):
        ended_run(redis_client, f"old{i}", ended_ms=start - 10_000 + i)
    small_run(redis_client, "running").mark_running("leader")
    small_run(redis_client, "created")
    failed = ended_run(redis_client, "failed", state=RunState.FAILED)
    redis_client.zadd(failed.keys.versions, {"7": 7})  # as if it had old snapshots
    redis_client.zadd(RUNS_INDEX, {"ghost": 0})  # a deletion cut short
    swept = apply_retention(redis_client, RetentionPolicy(keep_runs=3))
    assert swept.deleted == ["ghost", "old0", "old1", "old2"]
    assert "failed" in swept.released and failed.kept_versions() == [0]
    left = {r.decode() for r in redis_client.zrange(RUNS_INDEX, 0, -1)}
    assert left == {"old3", "old4", "failed", "running", "created"}
    assert apply_retention(redis_client, RetentionPolicy(keep_runs=3)).deleted == []


def test_fifty_finished_runs_stay_within_a_memory_bound(redis_client: redis.Redis) -> None:
    """The issue's check. Without release and retention each of these runs would keep 11
    snapshots of 257 KiB (fifty: over 140 MB); with them, Redis holds the final parameters
    and small keys of the newest KEEP runs, and nothing of the others."""
    keep = 10
    policy = RetentionPolicy(keep_runs=keep)
    baseline = used_memory(redis_client)
    started = time.monotonic()
    for i in range(50):
        store = new_run(redis_client, f"run{i:02d}", updates=10)
        release_if_ended(store, aggregate(store))
        apply_retention(redis_client, policy)
    elapsed = time.monotonic() - started
    left = [r.decode() for r in redis_client.zrange(RUNS_INDEX, 0, -1)]
    assert left == [f"run{i:02d}" for i in range(40, 50)]
    snapshot = snapshot_memory(RunStore(redis_client, left[0]))
    per_run = max(run_bytes(redis_client, run_id) for run_id in left)
    assert per_run < snapshot + 16 * 1024, per_run
    # The bound: KEEP runs at a snapshot and 16 KiB each, plus 4 MiB of allocator slack.
    grown = used_memory(redis_client) - baseline
    assert grown < keep * (snapshot + 16 * 1024) + 4 * 2**20, grown
    assert elapsed < 30, elapsed


def run_jobs(client: redis.Redis, queue_name: str) -> None:
    """Run the queue's aggregation jobs in this process, as the aggregator service's rq
    worker does in its work horse."""
    SimpleWorker([queue(client, queue_name)], connection=client,
                 serializer=JSONSerializer).work(burst=True)


def test_an_aggregation_job_frees_the_run_it_ends(redis_client: redis.Redis) -> None:
    store = new_run(redis_client, "job", updates=12)
    enqueue_aggregation(store, redis_client, "q")
    run_jobs(redis_client, "q")
    assert store.state() == RunState.FINISHED
    assert store.kept_versions() == [12] and store.checkpointed_moments() == (-1, {})


def test_an_aggregation_job_of_a_deleted_run_leaves_nothing_behind(
        redis_client: redis.Redis) -> None:
    """gemq rm --force of a queued run: if an aggregator service takes the job just before
    the deletion, the job finds no run and fails; it must not write a status back."""
    enqueue_aggregation(small_run(redis_client, "raced"), redis_client, "q")
    delete_run(redis_client, "raced", force=True)
    run_jobs(redis_client, "q")
    assert run_keys(redis_client, "raced") == set()


def test_a_local_runs_aggregator_process_frees_the_run_it_ends(
        redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    """The aggregator process gemq run (gemq.train) starts:
    gemq.aggregation.aggregator.aggregator_main."""
    store = new_run(redis_client, "local", updates=12)
    process = multiprocessing.get_context("spawn").Process(
        target=aggregator_main, args=(redis_server.url, "local", 2000))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert store.state() == RunState.FINISHED
    assert store.kept_versions() == [12] and store.checkpointed_moments() == (-1, {})
