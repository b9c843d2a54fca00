"""Held-out evaluation during a run: claimed once per multiple of eval_every, by whichever
worker loads it first; carried into the metrics by the next commit (real Redis, the real
aggregator and commit script)."""

from __future__ import annotations

import json
import threading

import numpy as np
import redis
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gemq.aggregation.aggregator import Aggregator, AggregatorOptions
from gemq.state.store import RunState, RunStore
from gemq.training.evaluate import evaluate
from gemq.training.heldout import EVAL_SAMPLES, HeldOutEvaluation
from tests.helpers import SMALL_LAYOUT, gradient_message, small_run


def test_each_multiple_is_claimed_once_and_a_late_worker_skips_it(
        redis_client: redis.Redis) -> None:
    store = small_run(redis_client, "claims")
    assert store.claim_evaluation(3)
    assert not store.claim_evaluation(3)  # another worker, the same multiple
    assert not store.claim_evaluation(2)  # a worker behind: that one is past
    assert store.claim_evaluation(4)


def _recorded(client: redis.Redis, store: RunStore) -> list[dict[str, str]]:
    """The evaluations waiting for a commit, oldest first."""
    pairs = [json.loads(raw) for raw in client.lrange(store.keys.evaluations, 0, -1)]
    return [dict(zip(p[::2], p[1::2], strict=True)) for p in pairs]


def test_two_workers_evaluate_each_multiple_once_on_the_first_held_out_samples(
        redis_client: redis.Redis) -> None:
    store = small_run(redis_client, "two", eval_every=100)
    config = store.config()
    torch.manual_seed(0)
    test = TensorDataset(torch.randn(EVAL_SAMPLES + 300, 8), torch.randint(0, 4, (812,)))
    model = nn.Linear(8, 4)
    loss = nn.functional.cross_entropy
    a = HeldOutEvaluation(store, config, test, loss)
    b = HeldOutEvaluation(store, config, test, loss)
    a.evaluate_if_due(99, model)
    assert not redis_client.exists(store.keys.evaluations)  # not due before 100
    a.evaluate_if_due(104, model)
    (recorded,) = _recorded(redis_client, store)
    first = evaluate(model, torch.utils.data.Subset(test, range(EVAL_SAMPLES)), loss=loss)
    assert recorded["eval_updates"] == "104"
    assert float(recorded["test_loss"]) == float(f"{first[0]:.6g}")
    assert float(recorded["test_accuracy"]) == float(f"{first[1]:.6g}")
    redis_client.delete(store.keys.evaluations)
    b.evaluate_if_due(150, model)  # multiple 1 is a's
    assert not redis_client.exists(store.keys.evaluations)
    b.evaluate_if_due(230, model)
    assert [e["eval_updates"] for e in _recorded(redis_client, store)] == ["230"]
    redis_client.delete(store.keys.evaluations)
    a.evaluate_if_due(260, model)  # multiple 2 is b's
    assert not redis_client.exists(store.keys.evaluations)
    never = HeldOutEvaluation(store, config.replace(eval_every=0), test, loss)
    never.evaluate_if_due(10_000, model)
    assert not redis_client.exists(store.keys.evaluations)


def test_the_next_commit_carries_the_evaluation_into_the_metrics(
        redis_client: redis.Redis) -> None:
    store = small_run(redis_client, "carried", budget_updates=6, read_batch=1)
    rng = np.random.default_rng(0)

    def publish(count: int) -> None:
        for _ in range(count):
            gradient = rng.standard_normal(SMALL_LAYOUT.size).astype(np.float32)
            store.publish_gradient("w0", gradient_message(store, "w0", gradient, version=0))

    publish(3)
    # Two before a commit (workers evaluate at once): neither is lost, each has an entry.
    store.record_evaluation(2, 0.5, 0.75)
    store.record_evaluation(3, 0.25, None)
    result: list[str] = []
    options = AggregatorOptions(lease_ms=1000, idle_block_ms=50)
    thread = threading.Thread(target=lambda: result.append(Aggregator(store, options).run()))
    thread.start()
    try:
        publish(3)  # after the first commit: the budget's rest
        thread.join(60)
    finally:
        store.request_stop()
        thread.join(10)
    assert result == [RunState.FINISHED]
    rows = [fields for _, fields in store.metrics_since("0-0", 100)]
    carried = [row for row in rows if "eval_updates" in row]
    assert [row["eval_updates"] for row in carried] == ["2", "3"], rows
    assert float(carried[0]["test_loss"]) == 0.5
    assert float(carried[0]["test_accuracy"]) == 0.75
    assert float(carried[1]["test_loss"]) == 0.25 and "test_accuracy" not in carried[1]
    assert all(row["loss"] for row in carried)  # ordinary commit entries besides
    assert not redis_client.exists(store.keys.evaluations)  # moved, not copied
