"""A model over Redis' 512 MB value limit: the 784-12000-12000-10 MLP of
benchmarks/big_models.py, 153.6 M float32 parameters (614 MB), in 10 shards on one real
Redis.

The run is laid out from the model's parameter shapes (no torch model is built); one worker's
gradient is published as a slice to every shard, through the worker's own transport; each
shard's leader (the aggregator's own Leader and Leadership, driven as tests/test_shards.py's
lockstep drives them) applies and commits its slice, and every shard's new parameters are
read back. The test process's peak RSS and Redis' peak memory are printed and bounded.

Then the same model end to end, as a user runs it: ``gemq run`` with no shard or budget
flag, a worker computing real gradients and an aggregator process per shard, a few dozen
updates, Redis' peak memory within the bound gemq printed when it sized the run.
"""

from __future__ import annotations

import gc
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from benchmarks.big_models import MLP_150M, mlp_shapes
from gemq.aggregation.aggregator import Leader, _sender
from gemq.aggregation.leadership import Leadership
from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.running.embedded import EmbeddedRedis
from gemq.shards import MAX_SHARD_BYTES
from gemq.state.connection import connect
from gemq.state.keys import MESSAGE_FIELD
from gemq.state.store import RunStore
from gemq.training.shardset import RunShards
from gemq.wire import codec

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ParamLayout.from_shapes(mlp_shapes(*MLP_150M))
STATE_BYTES = 4 * LAYOUT.size
SHARDS = 10  # ceil(614 MB / 64 MiB)
LR = 0.05
MB = 2**20
#: Redis' allocator (jemalloc) rounds a large allocation up to its size class, four per
#: doubling: a value takes up to 1.25 times its bytes (a shard's 58.6 MiB take 64 MiB).
ALLOCATED = 1.25


def rss_peak_reset() -> None:
    """Start a new peak of this process's RSS (Linux: /proc/self/clear_refs, "5")."""
    Path("/proc/self/clear_refs").write_text("5")


def rss(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def one_gradient() -> np.ndarray:
    """The worker's gradient: rising along the state, so a slice applied to the wrong
    shard could not go unnoticed (and cheap to make: no random numbers for 614 MB)."""
    gradient = np.arange(LAYOUT.size, dtype=np.float32)
    gradient *= np.float32(1e-9)
    return gradient


@pytest.fixture
def client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A client as a worker or aggregator opens one (large values sent without a copy)."""
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_150m_parameter_run_in_ten_shards_applies_a_gradient_slice_on_every_shard(
        client: redis.Redis) -> None:
    assert STATE_BYTES > 512 * MB  # more than one Redis value may hold
    rss_peak_reset()
    baseline = rss("VmRSS")
    config = RunConfig(run_id="big", algo="downpour", lr=LR, shards=SHARDS, budget_updates=10)
    store = RunStore(client, "big")
    store.create(config, LAYOUT, np.zeros(LAYOUT.size, np.float32))
    store.mark_running("test")
    shards = RunShards(store)
    assert max(shard.size for shard in shards.plan.shards) * 4 <= MAX_SHARD_BYTES

    gradient = one_gradient()
    messages = [codec.encode(run_id="big", worker_id="w1", param_version=0, samples=64,
                             loss=1.0, layout_id=shards.plan.layout_id_of(shard.index),
                             gradient=gradient[shard.slice])
                for shard in shards.plan.shards]
    shards.heartbeat("w1")
    views = shards.publish("w1", dict(enumerate(messages)))  # one MULTI: a slice to each
    del messages
    assert [view.pending for view in views] == [1] * SHARDS

    for shard, shard_store in zip(shards.plan.shards, shards.stores, strict=True):
        leader = Leader(shard_store, config, LAYOUT)
        lead = Leadership(shard_store, f"test-{shard.index}", 60_000)
        assert lead.acquire()
        entries = lead.read(10).entries
        assert len(entries) == 1
        plan = leader.process([(entry_id, fields.get(MESSAGE_FIELD.encode()), _sender(fields))
                               for entry_id, fields in entries if fields is not None])
        assert lead.commit(plan, leader.theta)
        del leader, entries, plan
        gc.collect()
        version, params = shard_store.latest()  # read back from Redis
        assert version == 1
        expected = -np.float32(LR) * gradient[shard.slice]  # downpour from zero: -lr g
        np.testing.assert_allclose(params, expected, rtol=1e-6, atol=0)
        assert shard_store.counters()["applied"] == 1
        assert client.exists(shard_store.keys.moment("w1"))  # a new leader's first commit
        del params, expected

    peak_rss = rss("VmHWM") - baseline
    memory = client.info("memory")
    print(f"\n150 M parameters in {SHARDS} shards: test process peak RSS "
          f"+{peak_rss / MB:.0f} MB over its {baseline / MB:.0f} MB start; Redis used_memory "
          f"{memory['used_memory'] / MB:.0f} MB, peak {memory['used_memory_peak'] / MB:.0f} MB "
          f"(state {STATE_BYTES / MB:.0f} MB)")
    # The process holds the gradient and its messages (a state's bytes each), and one
    # shard's leader at a time: its parameters, the snapshot it loads and the one it keeps,
    # the read message and the rule's buffers, a shard's bytes each.
    assert peak_rss < 2 * STATE_BYTES + 8 * MAX_SHARD_BYTES
    # What Redis keeps of the run, per shard: two versions (the initial one and the new)
    # and the worker's momentum, checkpointed by the commit (gemq/aggregation/checkpoints.py): three
    # states, each value rounded up to its allocation (ALLOCATED). The commit deleted the
    # applied slice from the stream.
    kept = 3 * STATE_BYTES * ALLOCATED
    assert memory["used_memory"] < kept + 2 * MAX_SHARD_BYTES
    # On top of that, at the peak: the slices in the streams until their shards applied
    # them (a state), and values on their way in or out: a staged parameter vector, a
    # read's reply, a snapshot's GET (a shard's bytes each). While the gradient is
    # published, the MULTI holds every slice queued until EXEC while each XADD copies its
    # own: that peak (two states and the initial version) is lower.
    in_flight = STATE_BYTES * ALLOCATED
    assert memory["used_memory_peak"] < kept + in_flight + 6 * MAX_SHARD_BYTES


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_shard_for_such_a_model_is_refused_naming_the_shards_it_needs(
        redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gemq", "create", "--redis-url", redis_server.url,
         "--model", "benchmarks.big_models:mlp_150m", "--dataset", "digits", "--shards", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "gemq: error: shards: the model's state is 586 MB; shards hold at most 64 MB, so it "
        f"needs --shards {SHARDS} or more"]
    assert redis_client.dbsize() == 0  # refused before anything was written


#: The end-to-end run: no shard or budget flag, gemq sizes it (gemq/running/sizing.py).
E2E_STEPS = 30


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_150m_parameter_model_trains_end_to_end_sized_by_gemq_within_the_bound_it_printed(
        tmp_path: Path) -> None:
    """``gemq run`` of the 784-12000-12000-10 MLP as a user types it, with no shard or
    budget flag: gemq chooses the shards and what is in flight for this machine's memory and
    says the most its private Redis can hold; a worker computes real gradients, an
    aggregator process per shard applies them (GEM), and the Redis' peak stays within what
    was printed."""
    summary_path = tmp_path / "summary.json"
    command = [sys.executable, "-m", "gemq", "run", "--model", "benchmarks.big_models:mlp_150m",
               "--dataset", "mnist5k", "--workers", "1", "--batch-size", "16",
               "--steps", str(E2E_STEPS), "--lr", "0.01", "--run", "big-e2e",
               "--out", str(tmp_path), "--no-progress", "--json", str(summary_path),
               "--accept-poor-result"]  # 30 updates: a memory test, not a learning one
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"shards {SHARDS}: the fewest that hold it" in done.stderr, done.stderr
    printed = re.search(r"Redis memory: at most ([\d.]+) GB", done.stderr)
    assert printed, done.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["state"] == "finished"
    assert summary["config"]["shards"] == SHARDS
    assert summary["updates_applied"] == E2E_STEPS  # the slowest shard's count
    assert all(shard["applied"] >= E2E_STEPS for shard in summary["shards"]), summary["shards"]
    assert summary["rejected"] == {}, summary["rejected"]
    assert math.isfinite(summary["test_loss"])
    assert (tmp_path / "model.pt").stat().st_size > STATE_BYTES  # the trained state_dict
    print(f"\n150 M parameters end to end: {summary['updates_applied']} updates in "
          f"{summary['wall_time_s']:.0f} s, sized by gemq: max_pending "
          f"{summary['config']['max_pending']}, snapshots "
          f"{summary['config']['snapshot_budget_mb']} MB a shard; Redis peak "
          f"{summary['redis_peak_mb']:.0f} MB, bound printed {printed.group(1)} GB")
    assert summary["redis_peak_mb"] <= float(printed.group(1)) * 1024 + 52  # 0.05 GB rounding
