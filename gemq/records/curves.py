"""A run's curves as rows: one row per entry of its metrics stream (one aggregator commit that
applied updates), in one format for every writer: a local run's ``metrics.csv``,
``gemq export``, the API's CSV download and TensorBoard.

Columns, in order (``columns()``): the stream id; ``t_ms``, the commit's wall time in ms
since the Unix epoch; ``updates``, updates applied so far (the dashboard's x axis);
``applied`` and ``rejected`` in that commit; ``loss``, the mean training loss of its
gradients; ``accuracy``, the mean training accuracy of their minibatches (where the targets
are class indices); ``energy_ratio``, ``median_pi``; ``staleness_mean`` and ``staleness_max``, in
updates; ``active_workers``; ``updates_per_s`` as the dashboard computes it; then
``pi:<tensor>``, the median pi of each parameter tensor, which the aggregator samples about
once a second (empty between samples). A value that is missing or not a number is None
(an empty CSV cell, a JSON null).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import deque
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Protocol

from gemq.errors import ConfigError

if TYPE_CHECKING:
    from gemq.state.store import RunStore

CURVES_FILE = "metrics.csv"
FORMATS = ("csv", "jsonl")
PI_PREFIX = "pi:"
#: Stream fields that hold whole numbers, and those that hold real numbers.
#: A row's held-out columns are filled where a held-out evaluation landed (every
#: eval_every updates: gemq/training/heldout.py), of the parameters at ``eval_updates``.
HELD_OUT = ("eval_updates", "test_loss", "test_accuracy")
COUNTS = ("t_ms", "updates", "applied", "rejected", "staleness_max", "active_workers",
          "eval_updates")
MEASURES = ("loss", "accuracy", "energy_ratio", "median_pi", "staleness_mean", "e_central",
            "e_proxy", "test_loss", "test_accuracy")
BASE_COLUMNS = ("stream_id", "t_ms", "updates", "applied", "rejected", "loss", "accuracy",
                "energy_ratio", "median_pi", "staleness_mean", "staleness_max",
                "active_workers", "e_central", "e_proxy", "updates_per_s", "eval_updates",
                "test_loss", "test_accuracy")
#: updates_per_s: the rate over the last RATE_WINDOW_MS of wall time, left empty until the
#: rows span RATE_MIN_SPAN_MS (web/js/series.js's rateSeries: the dashboard's chart).
RATE_WINDOW_MS = 2000
RATE_MIN_SPAN_MS = 250
#: Stream entries read per round trip.
PAGE = 1000

Value = int | float | str | None
Row = dict[str, Value]


def columns(tensors: Sequence[str]) -> list[str]:
    """The header: the base columns, then one pi column per parameter tensor."""
    return [*BASE_COLUMNS, *(PI_PREFIX + name for name in tensors)]


def plotted(header: Sequence[str]) -> list[str]:
    """The columns plotted against ``updates``: all but the id, the time and the x axis."""
    return [c for c in header if c not in ("stream_id", "t_ms", "updates")]


class UpdateRate:
    """Updates per second over a sliding window of wall time, one row at a time."""

    def __init__(self) -> None:
        self._window: deque[tuple[int, int]] = deque()

    def add(self, t_ms: int, updates: int) -> float | None:
        window = self._window
        window.append((t_ms, updates))
        # Keep the newest row at least RATE_WINDOW_MS old as the window's start.
        while len(window) > 2 and t_ms - window[1][0] >= RATE_WINDOW_MS:
            window.popleft()
        start_ms, start_updates = window[0]
        span_ms = t_ms - start_ms
        if span_ms < RATE_MIN_SPAN_MS:
            return None
        return round(1000 * (updates - start_updates) / span_ms, 2)


class CurveRows:
    """Metrics stream entries, given in stream order, as rows of ``columns(tensors)``."""

    def __init__(self, tensors: Sequence[str]) -> None:
        self.tensors = list(tensors)
        self.columns = columns(self.tensors)
        self._rate = UpdateRate()

    def row(self, entry_id: str, fields: dict[str, str]) -> Row:
        """The row of one entry, its keys in column order."""
        values: Row = {"stream_id": entry_id}
        values.update({name: _count(fields.get(name)) for name in COUNTS})
        values.update({name: _measure(fields.get(name)) for name in MEASURES})
        t_ms, updates = values["t_ms"], values["updates"]
        values["updates_per_s"] = (self._rate.add(t_ms, updates) if isinstance(t_ms, int)
                                   and isinstance(updates, int) else None)
        pi = _pi_values(fields.get("pi_tensors"), len(self.tensors))
        values.update({PI_PREFIX + name: p for name, p in zip(self.tensors, pi, strict=True)})
        return {column: values[column] for column in self.columns}


def _count(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _measure(text: str | None) -> float | None:
    try:
        return _finite(float(text)) if text is not None else None
    except ValueError:
        return None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _pi_values(text: str | None, n: int) -> list[float | None]:
    """The per-tensor medians of a row (JSON list; null for a tensor not sampled), n long."""
    try:
        values = json.loads(text) if text else []
    except ValueError:
        values = []
    if not isinstance(values, list):
        values = []
    out = [_finite(float(v)) if isinstance(v, int | float) else None for v in values[:n]]
    return out + [None] * (n - len(out))


class CurveSink(Protocol):
    """Where rows go: a file format, or TensorBoard."""

    def write(self, rows: Sequence[Row]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def csv_text(header: Sequence[str], rows: Sequence[Row], with_header: bool = False) -> str:
    """``rows`` as CSV lines of ``header``'s columns (after a header line if asked)."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=header, lineterminator="\n")
    if with_header:
        writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


class CsvSink:
    """Rows as CSV with a header line; an empty cell for None."""

    def __init__(self, out: IO[str], header: Sequence[str]) -> None:
        self.out = out
        self.header = list(header)
        self.out.write(csv_text(self.header, [], with_header=True))

    def write(self, rows: Sequence[Row]) -> None:
        # Each batch goes out in one piece: a process killed between two flushes leaves
        # whole rows, never the first half of one.
        self.out.write(csv_text(self.header, rows))

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.close()


class JsonlSink:
    """Rows as JSON lines, keyed by column (None is null)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def write(self, rows: Sequence[Row]) -> None:
        self.out.writelines(json.dumps(row) + "\n" for row in rows)

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.close()


def file_sink(out: IO[str], fmt: str, header: Sequence[str]) -> CurveSink:
    """A sink writing ``fmt`` (one of FORMATS) to ``out``."""
    if fmt == "csv":
        return CsvSink(out, header)
    if fmt == "jsonl":
        return JsonlSink(out)
    raise ConfigError("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")


class CurveReader:
    """Reads a run's metrics stream as rows, from the start on, resuming where it stopped."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.rows = CurveRows([t.name for t in store.layout().params])
        self.last_id = "0-0"

    def pages(self) -> Iterator[list[Row]]:
        """The rows committed since the last call, a page per round trip, until none is
        left."""
        while True:
            entries = self.store.metrics_since(self.last_id, PAGE)
            if not entries:
                return
            self.last_id = entries[-1][0]
            yield [self.rows.row(entry_id, fields) for entry_id, fields in entries]
            if len(entries) < PAGE:
                return
