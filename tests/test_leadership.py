"""The leader's reads against a real Redis: entries nobody took come before new ones, and
each entry of a full stream is delivered once.

Redis' own count of the bytes it sent is the measure: a read that took entries only to
leave them pending (they come back through a later read) shows there as bytes sent twice.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import redis

from gemq.aggregation.aggregator import Aggregator, AggregatorOptions
from gemq.aggregation.leadership import Leadership, ReadRequest
from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.state import scripts
from gemq.state.keys import AGGREGATOR_CONSUMER, AGGREGATOR_GROUP
from gemq.state.store import RunState, RunStore
from gemq.wire import codec
from tests.helpers import gradient_message, small_run

#: 256 KiB gradients: every other reply is noise beside them.
LAYOUT = ParamLayout.from_shapes([("w", (65_536,))])
ENTRIES, READ_BATCH = 48, 4


def full_stream(client: redis.Redis) -> tuple[RunStore, np.ndarray]:
    """A DOWNPOUR run whose stream holds ENTRIES gradients, all on version 0; and their sum."""
    config = RunConfig.from_dict({"run_id": "full", "algo": "downpour", "lr": 1.0,
                                  "budget_updates": ENTRIES, "read_batch": READ_BATCH,
                                  "max_pending": 2 * ENTRIES, "max_staleness": ENTRIES})
    store = RunStore(client, "full")
    store.create(config, LAYOUT, np.zeros(LAYOUT.size, np.float32))
    store.mark_running("test")
    grads = np.random.default_rng(0).standard_normal((ENTRIES, LAYOUT.size), np.float32)
    for g in grads:
        store.publish_gradient("w1", codec.encode(
            run_id="full", worker_id="w1", param_version=0, samples=8, loss=1.0,
            layout_id=LAYOUT.layout_id, gradient=g))
    return store, grads.sum(axis=0)


def bytes_sent(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


@pytest.mark.parametrize("start", ["fresh_redis", "deposed_leaders_read"])
def test_a_full_stream_is_delivered_once_per_entry(redis_client: redis.Redis,
                                                   start: str) -> None:
    """Two ways a leader could start with a backlog in the pending list that made every
    later read move twice the bytes: its first read on a fresh Redis answered NOSCRIPT and
    sent again, or a deposed leader's read of two batches. Now each entry is delivered
    once (the scripts are loaded with the lease; the backlog is read before new entries),
    and every gradient applied once."""
    store, total = full_stream(redis_client)
    if start == "fresh_redis":
        redis_client.script_flush()
    else:
        for script in (scripts.RENEW, scripts.COMMIT):
            redis_client.script_load(script)
        redis_client.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER,
                                {store.keys.gradients: ">"}, count=2 * READ_BATCH)
    before = bytes_sent(redis_client)
    result: list[str] = []
    options = AggregatorOptions(lease_ms=2000, idle_block_ms=50)
    thread = threading.Thread(target=lambda: result.append(
        Aggregator(store, options).run(threading.Event())), daemon=True)
    thread.start()
    thread.join(60)
    deliveries = (bytes_sent(redis_client) - before) / (4 * LAYOUT.size)
    assert result == [RunState.FINISHED]
    assert store.counters() == {"published": ENTRIES, "applied": ENTRIES}
    np.testing.assert_allclose(store.latest()[1], -total, rtol=1e-4, atol=1e-4)
    # Sent besides the entries: version 0's parameters (read twice by the new leader: its
    # state, its first snapshot), and small replies.
    assert deliveries < ENTRIES + 2 + 0.5, deliveries


def test_entries_nobody_took_are_read_before_new_ones(redis_client: redis.Redis) -> None:
    """A deposed leader's read left E1, E2 pending. A read of new entries returns none (the
    new ones it moved, E3-E6, wait behind them) and reports the backlog; pending reads then
    return E1-E6 in order, the second past the entries already taken, and the backlog is
    gone once the pending list holds only taken entries."""
    store = small_run(redis_client)
    for _ in range(6):
        store.publish_gradient("w1", gradient_message(store, "w1", np.ones(36, np.float32)))
    ids = [entry_id.decode() for entry_id, _ in redis_client.xrange(store.keys.gradients)]
    redis_client.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER,
                            {store.keys.gradients: ">"}, count=2)
    lead = Leadership(store, "t", 5000)
    assert lead.acquire()
    read = lead.read(ReadRequest(10))
    assert read.entries == [] and read.backlog
    read = lead.read(ReadRequest(2, "0"))
    assert [i for i, _ in read.entries] == ids[:2] and read.backlog
    read = lead.read(ReadRequest(10, ids[1], taken=2))
    assert [i for i, _ in read.entries] == ids[2:] and not read.backlog
    read = lead.read(ReadRequest(10, taken=6))
    assert read.entries == [] and not read.backlog
    store.publish_gradient("w1", gradient_message(store, "w1", np.ones(36, np.float32)))
    read = lead.read(ReadRequest(10, taken=6))
    assert len(read.entries) == 1 and not read.backlog


def test_a_read_answered_noscript_leaves_its_entries_to_the_pending_read(
        redis_client: redis.Redis) -> None:
    """Redis lost its scripts mid-term (SCRIPT FLUSH): the read's first attempt moved E1, E2
    into the pending list before it was answered NOSCRIPT. The second attempt (moving E3,
    E4 behind them) returns nothing and reports the backlog; the pending read returns
    E1-E4, and the next read of new entries E5: nothing skipped."""
    store = small_run(redis_client)
    for _ in range(5):
        store.publish_gradient("w1", gradient_message(store, "w1", np.ones(36, np.float32)))
    ids = [entry_id.decode() for entry_id, _ in redis_client.xrange(store.keys.gradients)]
    lead = Leadership(store, "t", 5000)
    assert lead.acquire()
    redis_client.script_flush()
    read = lead.read(ReadRequest(2))
    assert read.entries == [] and read.backlog
    read = lead.read(ReadRequest(10, "0"))
    assert [i for i, _ in read.entries] == ids[:4] and not read.backlog
    assert [i for i, _ in lead.read(ReadRequest(10, taken=4)).entries] == ids[4:]
