"""Aggregator capacity against the transport ceiling, per model size.

The same producer processes keep the gradient stream full in every measurement (XADD of
valid gradient messages, waiting while the stream is at its bound, re-reading the head
version like a worker does). Only the consumer changes:

- ``ceiling``: a bare consumer. XREADGROUP until it holds a full batch (``read_batch``
  entries), then in one MULTI: SET the parameter bytes, HSET the head version, XACK,
  XTRIM. No validation, no rule: the bytes the aggregator must move, moved as cheaply as
  redis-py allows, through a client configured like gemq's own (``gemq.state.connection``: large
  values sent uncopied, 1 MiB socket reads); the producers use it too, like workers.
- ``gem``: the real aggregator process (gemq.aggregation.aggregator) on a real run, GEM on,
  publishing once per ``read_batch`` updates (``publish_every``).

Both therefore move the same bytes per update: one XADD and one XREADGROUP of the gradient,
and 1 / read_batch of a parameter SET. (A consumer that published after every read would
publish more often the faster it is, since a faster consumer finds fewer entries per read:
the "ceiling" would then be handicapped by its own speed.)

- ``ceiling_fp16`` / ``gem_fp16``, ``ceiling_bf16`` / ``gem_bf16``: the same with float16
  or bfloat16 wire payloads (half the bytes).

The ratio ``gem / ceiling`` is the transport ratio; the target is >= 0.8 for every size.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from benchmarks.perf.common import (
    MB,
    Budget,
    private_redis,
    ratio,
    start,
    stop,
    wait_for,
)
from benchmarks.perf.messages import Messages
from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.process import graceful_shutdown
from gemq.state.connection import connect
from gemq.state.keys import (
    AGGREGATOR_CONSUMER,
    AGGREGATOR_GROUP,
    MESSAGE_FIELD,
    SENDER_FIELD,
    RunKeys,
)
from gemq.state.store import RunStore
from gemq.wire import codec

NAME = "transport"
#: float32 parameters per model: the paper CNN, then 1 M and 11 M (a ResNet-18's order).
SIZES = {"cnn": 163_790, "1m": 1_000_000, "11m": 11_000_000}
PRODUCERS = 2
#: Bytes allowed in flight in the stream; bounds max_pending (and so Redis memory) for the
#: large models, where 64 pending messages of 44 MB would not fit next to anything else.
PENDING_BYTES = 256 * MB
VARIANTS = ("ceiling", "gem", "ceiling_fp16", "gem_fp16", "ceiling_bf16", "gem_bf16")
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Sizing:
    size: int
    max_pending: int
    read_batch: int
    history: int

    @classmethod
    def for_size(cls, size: int) -> Sizing:
        message = size * 4
        max_pending = int(np.clip(PENDING_BYTES // message, 4, 64))
        history = int(np.clip(PENDING_BYTES // message, 8, 64))
        return cls(size, max_pending, max(1, min(32, max_pending // 2)), history)


def layout_for(name: str, size: int) -> ParamLayout:
    """The paper CNN's real layout; for the synthetic sizes, ten equal tensors."""
    if name == "cnn":
        from gemq.training.models import PaperCNN, layout_of

        return layout_of(PaperCNN())
    return ParamLayout.from_shapes([(f"layer{i}", (size // 10,)) for i in range(10)])


def produce(url: str, run_id: str, layout_id: str, worker_id: str, size: int, dtype: str,
            max_pending: int, seed: int) -> None:
    """Keep the stream at its bound with valid gradients (byte-identical to codec.encode)."""
    shutdown = graceful_shutdown()
    keys, client = RunKeys(run_id), connect(url, retries=0)
    gradient = np.random.default_rng(seed).standard_normal(size, dtype=np.float32) * 1e-3
    messages = Messages(run_id, worker_id, layout_id, gradient, dtype)
    RunStore(client, run_id).heartbeat(worker_id)  # registers it, as a worker's first step
    while not shutdown.is_set():
        pipe = client.pipeline(transaction=False)
        pipe.hget(keys.head, "version")
        pipe.xlen(keys.gradients)
        raw_version, pending = pipe.execute()
        if pending >= max_pending:
            shutdown.wait(0.001)
            continue
        client.xadd(keys.gradients, {SENDER_FIELD: worker_id,
                                      MESSAGE_FIELD: messages.at(int(raw_version or 0))})
    client.close()


def bare_consume(url: str, run_id: str, size: int, read_batch: int) -> None:
    """The ceiling: move full batches and publish parameters; no validation, no rule."""
    shutdown = graceful_shutdown()
    keys, client = RunKeys(run_id), connect(url)
    params = np.zeros(size, np.float32).tobytes()
    client.set(keys.lease, "bare")
    consumed = 0
    while not shutdown.is_set():
        ids: list[bytes] = []
        while len(ids) < read_batch and not shutdown.is_set():
            reply = client.xreadgroup(AGGREGATOR_GROUP, AGGREGATOR_CONSUMER,
                                      {keys.gradients: ">"}, count=read_batch - len(ids),
                                      block=100)
            ids += [entry[0] for entry in reply[0][1]] if reply else []
        if not ids:
            continue
        consumed += len(ids)
        pipe = client.pipeline(transaction=True)
        pipe.set(keys.params(consumed), params)
        pipe.hset(keys.head, mapping={"version": consumed, "updates": consumed})
        pipe.xack(keys.gradients, AGGREGATOR_GROUP, *ids)
        pipe.xtrim(keys.gradients, minid=ids[-1])
        pipe.execute()
    client.close()


def _prepare(client: redis.Redis, run_id: str, name: str, sizing: Sizing, dtype: str,
             real_run: bool) -> ParamLayout:
    from gemq.state.store import RunStore

    layout = layout_for(name, sizing.size)
    if real_run:
        config = RunConfig(run_id=run_id, budget_updates=10**9, max_pending=sizing.max_pending,
                           read_batch=sizing.read_batch, history=sizing.history,
                           wire_dtype=dtype, publish_every=sizing.read_batch)
        RunStore(client, run_id).create(config, layout, np.zeros(layout.size, np.float32))
    else:
        keys = RunKeys(run_id)
        client.hset(keys.head, mapping={"version": 0, "updates": 0})
        client.xgroup_create(keys.gradients, AGGREGATOR_GROUP, id="0", mkstream=True)
    return layout


def measure(url: str, client: redis.Redis, name: str, variant: str,
            window_s: float) -> dict[str, Any]:
    """Updates (messages consumed) per second of one consumer, the stream kept full."""
    sizing = Sizing.for_size(SIZES[name])
    dtype = DTYPES.get(variant.rpartition("_")[2], "float32")
    real_run = variant.startswith("gem")
    run_id = f"bench-{name}-{variant.replace('_', '-')}"
    client.flushall()
    layout = _prepare(client, run_id, name, sizing, dtype, real_run)
    consumer = _consumer(url, run_id, variant, sizing)
    producers = [start(produce, url, run_id, layout.layout_id, f"producer-{i}", layout.size,
                       dtype, sizing.max_pending, i, name=f"producer-{i}")
                 for i in range(PRODUCERS)]
    keys = RunKeys(run_id)
    try:
        def updates() -> int:
            return int(client.hget(keys.head, "updates") or 0)

        wait_for(lambda: updates() >= 2 * sizing.read_batch, 120, f"{variant} to start")
        rate, fill = _window(updates, client, keys.gradients, window_s)
    finally:
        _stop_consumer(client, run_id, real_run, consumer)
        stop(producers)
    rejected = {k.decode(): int(v) for k, v in client.hgetall(keys.counters).items()
                if k.startswith(b"rejected:")}
    itemsize = codec.WIRE_DTYPES[dtype].itemsize
    return {"updates_per_s": round(rate, 2),
            "mb_per_s": round(rate * layout.size * itemsize / MB, 1),
            "stream_fill": round(fill, 3), "rejected": rejected}


def _consumer(url: str, run_id: str, variant: str, sizing: Sizing) -> Any:
    if variant.startswith("gem"):
        from gemq.aggregation.aggregator import aggregator_main

        return start(aggregator_main, url, run_id, 5000, name="aggregator")
    return start(bare_consume, url, run_id, sizing.size, sizing.read_batch,
                 name="bare-consumer")


def _stop_consumer(client: redis.Redis, run_id: str, real_run: bool, consumer: Any) -> None:
    if real_run:
        from gemq.state.store import RunStore

        RunStore(client, run_id).request_stop()
        consumer.join(30)
    stop([consumer])


def _window(read: Any, client: redis.Redis, stream: str,
            seconds: float) -> tuple[float, float]:
    """(rate of ``read`` over the window, mean stream length / its bound)."""
    lengths, first, t0 = [], read(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        time.sleep(0.1)
        lengths.append(client.xlen(stream))
    last, t1 = read(), time.monotonic()
    return (last - first) / (t1 - t0), statistics.fmean(lengths) if lengths else 0.0


def run(budget: Budget) -> dict[str, Any]:
    names = budget.pick(list(SIZES), ["cnn"])
    variants = VARIANTS
    #: The 11 M model moves a few updates per second: a longer window for as many samples.
    windows = {"cnn": budget.seconds(6.0, 1.0), "1m": budget.seconds(6.0, 1.0),
               "11m": budget.seconds(12.0, 2.0)}
    raw: dict[str, dict[str, Any]] = {}
    with private_redis() as (server, client):
        for name in names:
            sizing = Sizing.for_size(SIZES[name])
            raw[name] = {"parameters": SIZES[name], "max_pending": sizing.max_pending,
                         "read_batch": sizing.read_batch, "history": sizing.history}
            # The headline pair is measured again at the end (A B ... A B): the ratio uses
            # the mean of both, so a load spike on a shared machine shows as their spread.
            for variant in [*variants, "ceiling", "gem"]:
                result = measure(server.url, client, name, variant, windows[name])
                result["stream_fill"] = round(result["stream_fill"] / sizing.max_pending, 3)
                if variant in raw[name]:
                    _merge_repeat(raw[name][variant], result)
                else:
                    raw[name][variant] = result
    return summarise(raw)


def _merge_repeat(first: dict[str, Any], again: dict[str, Any]) -> None:
    first["repeats"] = [first["updates_per_s"], again["updates_per_s"]]
    first["updates_per_s"] = round(statistics.fmean(first["repeats"]), 2)
    first["mb_per_s"] = round((first["mb_per_s"] + again["mb_per_s"]) / 2, 1)


def summarise(raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def rate(name: str, variant: str) -> float | None:
        entry = raw[name].get(variant)
        return entry["updates_per_s"] if entry else None

    out: dict[str, Any] = {"transport_ratio": {}, "transport_ratio_spread": {},
                           "transport_ratio_fp16": {}, "transport_ratio_bf16": {},
                           "wire_fp16_speedup": {}, "wire_bf16_speedup": {}, "runs": raw}
    for name in raw:
        out["transport_ratio"][name] = ratio(rate(name, "gem"), rate(name, "ceiling"))
        pairs = zip(raw[name]["gem"].get("repeats", []),
                    raw[name]["ceiling"].get("repeats", []), strict=True)
        out["transport_ratio_spread"][name] = [ratio(g, c) for g, c in pairs]
        for short in DTYPES:
            out[f"transport_ratio_{short}"][name] = ratio(rate(name, f"gem_{short}"),
                                                          rate(name, f"ceiling_{short}"))
            # > 1: the aggregator moves more updates per second with half the bytes.
            out[f"wire_{short}_speedup"][name] = ratio(rate(name, f"gem_{short}"),
                                                       rate(name, "gem"))
    return out
