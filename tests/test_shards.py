"""Sharded runs: the plan, exactness against the unsharded run, and shards on their own.

Exactness is checked in lockstep: one real worker publishes a gradient to every shard, then
each shard's leader (the aggregator's own Leader and Leadership) applies and commits it,
then the worker reads every shard's new parameters. The order of events is then fixed, so
the final parameters depend only on the sharding.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import redis

from gemq.aggregation.aggregator import Aggregator, Leader, _sender
from gemq.aggregation.leadership import Leadership
from gemq.config import RunConfig
from gemq.errors import ConfigError
from gemq.layout import ParamLayout
from gemq.records import combine
from gemq.running.embedded import EmbeddedRedis
from gemq.running.runs import create_run
from gemq.shards import MAX_SHARD_BYTES, ShardPlan
from gemq.state.store import RunState, RunStore
from gemq.training.data import load_dataset
from gemq.training.worker import Worker
from gemq.wire import codec
from tests.helpers import GemqProcess, wait_for

# --- the plan ---------------------------------------------------------------------------

LAYOUT = ParamLayout.from_shapes([("a.w", (100, 10)), ("a.b", (100,)), ("b.w", (10, 100)),
                                  ("b.b", (10,)), ("c.w", (3, 10))])


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 64])
def test_shards_cover_the_state_in_order_without_overlap(count: int) -> None:
    plan = ShardPlan.of(LAYOUT, count)
    assert plan.count == count and plan.size == LAYOUT.size
    assert plan.shards[0].start == 0 and plan.shards[-1].stop == LAYOUT.size
    for a, b in zip(plan.shards, plan.shards[1:], strict=False):
        assert a.stop == b.start and a.size > 0


def test_cuts_fall_on_tensor_boundaries_when_that_keeps_shards_balanced() -> None:
    plan = ShardPlan.of(LAYOUT, 2)  # 2140 elements: a.w + a.b = 1100 is within 10% of 1070
    assert [s.start for s in plan.shards] == [0, 1100]
    plan = ShardPlan.of(LAYOUT, 4)  # ideal cuts 535, 1070, 1605: 1100 moves, the others not
    assert [s.start for s in plan.shards] == [0, 535, 1100, 1605]


def test_a_slice_of_one_shard_or_layout_is_never_taken_for_another() -> None:
    ids = {ShardPlan.of(LAYOUT, n).layout_id_of(k) for n in (1, 2, 4) for k in range(n)}
    assert len(ids) == 1 + 2 + 4
    assert ShardPlan.of(LAYOUT, 1).layout_id_of(0) == LAYOUT.layout_id  # as before shards


def test_too_few_or_too_many_shards_is_one_clear_error() -> None:
    big = ParamLayout.from_shapes([("w", (MAX_SHARD_BYTES // 4 + 1,))])
    with pytest.raises(ConfigError, match="needs --shards 2 or more"):
        ShardPlan.of(big, 1)
    with pytest.raises(ConfigError, match="3 shards for a state of 2 elements"):
        ShardPlan.of(ParamLayout.from_shapes([("w", (2,))]), 3)


# --- exactness --------------------------------------------------------------------------


def lockstep(client: redis.Redis, run_id: str, steps: int, behind: int = 0,
             **settings: object) -> np.ndarray:
    """Train ``steps`` updates with one worker, in lockstep; return the final state. The
    last shard's aggregator skips the last ``behind`` of them (their slices stay queued)."""
    config = RunConfig.from_dict({"run_id": run_id, "model": "mlp", "dataset": "digits",
                                  "batch_size": 16, "budget_updates": steps + 1, **settings})
    data = load_dataset("digits")
    store = create_run(client, config, data)
    store.mark_running("lockstep")
    shards = store.shards()
    leaders = [Leader(s, config, s.layout()) for s in shards]
    leads = [Leadership(s, f"lockstep-{s.shard}", 60_000) for s in shards]
    assert all(lead.acquire() for lead in leads)
    worker = Worker(store, "w1", config, data)
    never = threading.Event()
    for step in range(steps):
        worker._next_views = None  # read the views afresh: the gradient is on the newest
        assert worker._step(never)
        active = leaders if step < steps - behind else leaders[:-1]
        for leader, lead in zip(active, leads, strict=False):
            entries = lead.read(10).entries
            assert len(entries) == 1
            plan = leader.process([(i, f.get(b"m"), _sender(f)) for i, f in entries
                                   if f is not None])
            assert lead.commit(plan, leader.theta)
    applied = [steps] * (len(shards) - 1) + [steps - behind]
    assert [s.counters().get("applied") for s in shards] == applied
    assert all(s.counters().get("published") == steps for s in shards)
    return combine.latest_state(shards)[1].copy()


@pytest.mark.parametrize("algo", ["downpour", "gem", "dcasgd"])
def test_sharded_runs_end_with_the_unsharded_runs_parameters(redis_client: redis.Redis,
                                                             algo: str) -> None:
    steps = 40
    whole = lockstep(redis_client, f"{algo}-1", steps, algo=algo)
    for count in (2, 4):
        sharded = lockstep(redis_client, f"{algo}-{count}", steps, algo=algo, shards=count)
        if algo == "downpour":  # theta -= lr * g, element by element: bit for bit
            np.testing.assert_array_equal(sharded, whole)
        else:  # element-wise too; float32 rounding is all that may differ
            np.testing.assert_allclose(sharded, whole, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(whole, lockstep(redis_client, f"{algo}-0", 1, algo=algo))


def test_every_shards_metrics_rows_carry_the_rising_minibatch_accuracy(
        redis_client: redis.Redis) -> None:
    """A real worker's step measures its minibatch's accuracy and sends it with each shard's
    slice; each shard's commit (one gradient each, in lockstep) writes it into its row."""
    steps = 60
    lockstep(redis_client, "acc", steps, algo="gem", shards=2)
    per_shard = [[float(row["accuracy"]) for _, row in store.metrics_since("0-0", 1000)]
                 for store in RunStore(redis_client, "acc").shards()]
    accuracy = per_shard[0]
    assert per_shard[1] == accuracy and len(accuracy) == steps
    assert all(0.0 <= a <= 1.0 and (a * 16).is_integer() for a in accuracy)  # of 16 samples
    first, last = np.mean(accuracy[:15]), np.mean(accuracy[-15:])
    assert last > first + 0.2, (first, last)


def test_a_run_of_one_shard_has_exactly_the_keys_it_had_before_shards(
        redis_client: redis.Redis) -> None:
    lockstep(redis_client, "one", 3, algo="gem")
    keys = {k.decode() for k in redis_client.scan_iter("gemq:*")}
    assert all(k.startswith("gemq:{one}:") for k in keys if "one" in k)
    lockstep(redis_client, "two", 3, algo="gem", shards=2)
    assert any(k.decode().startswith("gemq:{two/1}:") for k in redis_client.scan_iter("gemq:*"))
    assert not redis_client.exists("gemq:{two}:shard_tags")  # a plain Redis places nothing


# --- shards on their own ----------------------------------------------------------------


def test_a_run_ends_once_every_shard_has_ended(redis_client: redis.Redis) -> None:
    config = RunConfig(run_id="ends", model="logreg", dataset="digits", shards=3)
    store = create_run(redis_client, config)
    store.mark_running("t")
    shards = store.shards()
    for shard in shards[:2]:
        redis_client.hset(shard.keys.head, mapping={"state": RunState.FINISHED})
        assert store.conclude() is None
        assert store.state() == RunState.RUNNING
    redis_client.hset(shards[2].keys.head, mapping={"state": RunState.STOPPED})
    assert store.conclude() == RunState.STOPPED  # finished only if every shard finished


def test_one_failed_shard_fails_the_run_with_its_error(redis_client: redis.Redis) -> None:
    store = create_run(redis_client, RunConfig(run_id="fails", model="logreg",
                                               dataset="digits", shards=2))
    store.mark_running("t")
    redis_client.hset(store.of_shard(1).keys.head,
                      mapping={"state": RunState.FAILED, "error": "stalled: out_of_range"})
    assert store.conclude() == RunState.FAILED
    assert store.status()["error"] == "stalled: out_of_range"


def test_a_worker_feeds_the_shards_with_room_and_skips_a_full_one(
        redis_client: redis.Redis) -> None:
    """Backpressure per shard: shard 1 has no aggregator, so its stream fills up to
    max_pending and stays there, while shard 0 takes every step's slice."""
    store = create_run(redis_client, RunConfig(run_id="skips", model="mlp", dataset="digits",
                                               batch_size=16, budget_updates=10**6,
                                               shards=2, max_pending=4))
    store.mark_running("test")
    shard0, shard1 = store.shards()
    stop = threading.Event()
    aggregator = threading.Thread(target=Aggregator(shard0).run, args=(stop,))
    worker = Worker(store, "w1", store.config(), load_dataset("digits"))
    working = threading.Thread(target=worker.run, args=(stop,))
    aggregator.start()
    working.start()
    try:
        wait_for(lambda: shard0.counters().get("applied", 0) >= 30, timeout_s=60,
                 what="shard 0 going on")
        assert redis_client.xlen(shard1.keys.gradients) == 4
        assert shard1.counters()["published"] == 4 and shard1.head().updates == 0
    finally:
        stop.set()
        aggregator.join(30)
        working.join(30)


@pytest.mark.slow
def test_sigkilling_one_shards_aggregator_pauses_that_shard_only(
        redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    """Ten SIGKILLs of shard 1's aggregator under DOWNPOUR: every slice is applied exactly
    once on both shards (each shard's parameters are minus lr times the sum of its slices),
    and shard 0, whose aggregator is never touched, never waits longer than one lease."""
    total, lease_ms, lr = 600, 2000, 0.01
    store = RunStore(redis_client, "halves")
    config = RunConfig(run_id="halves", algo="downpour", lr=lr, budget_updates=total,
                       shards=2, read_batch=4)
    store.create(config, LAYOUT, np.zeros(LAYOUT.size, np.float32))
    plan = store.plan()
    grads = np.random.default_rng(3).standard_normal((total, LAYOUT.size), dtype=np.float32)
    args = ("aggregator", "--run", "halves", "--redis-url", redis_server.url, "--lease-ms",
            str(lease_ms))
    first = GemqProcess(*args, "--shard", "0")
    second = GemqProcess(*args, "--shard", "1")
    shard0, shard1 = store.shards()
    # One publisher per shard, as workers feed each shard that has room.
    publishers = [threading.Thread(target=_publish_slices, args=(s, plan, grads))
                  for s in (shard0, shard1)]
    progress: list[tuple[float, int]] = []
    watching = threading.Event()
    watcher = threading.Thread(target=_watch, args=(shard0, progress, watching))
    try:
        for thread in (*publishers, watcher):
            thread.start()
        for kill in range(10):
            target = (kill + 1) * total // 12
            wait_for(lambda t=target: shard1.head().updates >= t, timeout_s=60,
                     what=f"shard 1 at {target}")
            second.send_signal(signal.SIGKILL)
            second.wait()
            second.stop()
            second = GemqProcess(*args, "--shard", "1")
        assert first.wait(120) == 0, first.output()
        assert second.wait(120) == 0, second.output()
    finally:
        watching.set()
        for process in (first, second):
            process.stop()
        for thread in (*publishers, watcher):
            thread.join(30)
    for shard in (shard0, shard1):
        assert shard.counters() == {"published": total, "applied": total}
        part = plan.shards[shard.shard].slice
        np.testing.assert_allclose(combine.latest_state([shard])[1],
                                   -lr * grads[:, part].sum(axis=0), rtol=1e-4, atol=1e-5)
    assert store.state() == RunState.FINISHED
    updates = [(t, n) for t, n in progress if n < total]
    gaps = [b[0] - a[0] for a, b in zip(updates, updates[1:], strict=False) if b[1] > a[1]]
    print(f"shard 0: longest wait between updates {max(gaps):.3f}s (lease {lease_ms} ms)")
    assert max(gaps) < lease_ms / 1000


def _publish_slices(store: RunStore, plan: ShardPlan, grads: np.ndarray) -> None:
    part = plan.shards[store.shard].slice
    for g in grads:
        wait_for(lambda: store.client.xlen(store.keys.gradients) < 16, timeout_s=60,
                 what="room in the stream")
        store.publish_gradient("w1", codec.encode(
            run_id=store.run_id, worker_id="w1", param_version=store.head().version,
            samples=8, loss=1.0, layout_id=plan.layout_id_of(store.shard),
            gradient=g[part]))


def _watch(store: RunStore, progress: list[tuple[float, int]], done: threading.Event) -> None:
    while not done.wait(0.02):
        progress.append((time.monotonic(), store.head().updates))


def test_the_service_enqueues_one_aggregation_job_per_shard(redis_client: redis.Redis) -> None:
    from gemq.services.api import views
    from gemq.services.jobs import enqueue_aggregation, queue

    store = create_run(redis_client, RunConfig(run_id="three", model="logreg",
                                               dataset="digits", shards=3))
    first = enqueue_aggregation(store, redis_client, "gemq-test")
    assert first == "gemq-aggregate-three"
    assert sorted(queue(redis_client, "gemq-test").job_ids) == [
        "gemq-aggregate-three", "gemq-aggregate-three-shard-1", "gemq-aggregate-three-shard-2"]
    view = views.run_view(store, redis_client)
    assert [s["shard"] for s in view["shards"]] == [0, 1, 2]
    assert view["progress"]["updates"] == 0


def test_the_run_view_names_each_shards_leader_and_backlog(redis_client: redis.Redis) -> None:
    from gemq.services.api import views

    store = create_run(redis_client, RunConfig(run_id="led", model="logreg",
                                               dataset="digits", shards=2))
    plan = store.plan()
    _publish_slices(store.of_shard(1), plan, np.zeros((3, plan.size), np.float32))
    lead = Leadership(store, "host:1:0badcafe", lease_ms=5000)
    assert lead.acquire()
    view = views.run_view(store, redis_client)
    assert [(s["leader"], s["backlog"]) for s in view["shards"]] == [
        ("host:1:0badcafe", 0), (None, 3)]
    lead.release()
    assert views.run_view(store, redis_client)["shards"][0]["leader"] is None


def test_the_run_wide_energy_ratio_sums_the_shards_energies(redis_client: redis.Redis) -> None:
    """GEM's energies are sums over the parameters: a run of 2 shards, summed, has the
    energy ratio of the same run unsharded (one worker in lockstep: the same updates)."""
    from gemq.services.api import views

    lockstep(redis_client, "energy-whole", 20, algo="gem")
    lockstep(redis_client, "energy-halves", 20, algo="gem", shards=2)
    whole = views.run_view(RunStore(redis_client, "energy-whole"), redis_client)
    halves = views.run_view(RunStore(redis_client, "energy-halves"), redis_client)
    (one,) = whole["shards"]
    assert whole["shards_overall"]["energy_ratio"] == pytest.approx(
        one["e_central"] / one["e_proxy"], rel=1e-9)
    overall, shards = halves["shards_overall"], halves["shards"]
    assert overall["energy_ratio"] == pytest.approx(whole["shards_overall"]["energy_ratio"],
                                                    rel=1e-4)
    # ...which the mean of the shards' own ratios is not.
    mean_of_ratios = sum(s["energy_ratio"] for s in shards) / len(shards)
    assert abs(mean_of_ratios - overall["energy_ratio"]) > 1e-3 * overall["energy_ratio"]
    assert overall["staleness_mean"] == pytest.approx(
        sum(s["staleness_mean"] for s in shards) / 2)
    assert overall["median_pi_range"] == [min(s["median_pi"] for s in shards),
                                          max(s["median_pi"] for s in shards)]


def test_the_run_wide_row_waits_for_every_shard_to_measure() -> None:
    measured = {"e_central": 2.0, "e_proxy": 4.0, "staleness_mean": 1.0, "median_pi": 0.5}
    silent = dict.fromkeys(measured)
    assert combine.overall([measured, silent]) == {
        "energy_ratio": None, "staleness_mean": None, "staleness_mean_max": None,
        "median_pi_range": None}
    assert combine.overall([measured, measured])["energy_ratio"] == 0.5
