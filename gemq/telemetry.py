"""What the aggregator and the workers report about their own work, and to whom.

The loops in gemq/aggregation/aggregator.py and gemq/training/worker.py time their phases
and hand the numbers to an observer passed in their options. The observers here do nothing:
the library needs no metrics package, and a loop without an exporter pays two clock reads
and a call to an empty method per batch or step (docs/performance.md, "Telemetry"). The
services subclass them to export Prometheus histograms (gemq/services/telemetry.py).

Times are seconds of wall clock (time.perf_counter or time.monotonic differences).
"""

from __future__ import annotations


class AggregatorObserver:
    """Told about each batch an aggregator applies and each window it commits."""

    def batch_applied(self, entries: int, seconds: float) -> None:
        """``entries`` stream entries (a read, at least one) were decoded, checked and
        applied to the parameters in memory in ``seconds``."""

    def window_committed(self, entries: int, seconds: float) -> None:
        """One atomic commit acknowledging ``entries`` took ``seconds``: the round trip to
        Redis, including the next read when it shares that round trip."""


class WorkerObserver:
    """Told about each gradient a worker computes and publishes."""

    def step_computed(self, seconds: float) -> None:
        """One gradient was computed on a minibatch and encoded in ``seconds``."""

    def gradient_published(self, message_bytes: int, seconds: float) -> None:
        """One gradient message of ``message_bytes`` went into the stream in ``seconds``
        (the round trip that also brings back the next step's view)."""


#: The observers used when none is given: they ignore everything.
SILENT_AGGREGATOR = AggregatorObserver()
SILENT_WORKER = WorkerObserver()
