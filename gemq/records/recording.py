"""A local run's curves, written while it runs: ``metrics.csv`` beside the model, and
TensorBoard scalars where asked for. Rows are flushed at every poll, so a run that is killed
leaves its curves up to its last poll."""

from __future__ import annotations

import csv
from pathlib import Path
from types import TracebackType

from gemq.records.curves import CsvSink, CurveReader, CurveSink
from gemq.state.store import RunStore


class CurveRecorder:
    """Follows a run's metrics stream and appends each new entry to its sinks."""

    def __init__(self, store: RunStore, path: Path, tensorboard: Path | None = None, *,
                 append: bool = False) -> None:
        """``append``: the run is resumed, and ``path`` holds its curves so far: rows past
        the run's restored metrics (written after its last saved state) are dropped, and
        the new ones follow."""
        self.reader = CurveReader(store)
        header = self.reader.rows.columns
        path.parent.mkdir(parents=True, exist_ok=True)
        csv_sink = (_appended(path, header, self.reader, store) if append and path.exists()
                    else CsvSink(path.open("w", newline=""), header))
        self.sinks: list[CurveSink] = [csv_sink]
        if tensorboard is not None:
            from gemq.records.tensorboard_curves import TensorBoardSink

            # One folder per run: `tensorboard --logdir DIR` then compares runs.
            self.sinks.append(TensorBoardSink(tensorboard / store.run_id, header))

    def poll(self) -> None:
        """Write what was committed since the last poll, and flush it."""
        wrote = False
        for rows in self.reader.pages():
            for sink in self.sinks:
                sink.write(rows)
            wrote = True
        if wrote:
            for sink in self.sinks:
                sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> CurveRecorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _appended(path: Path, header: list[str], reader: CurveReader, store: RunStore) -> CsvSink:
    """A sink that goes on after ``path``'s rows up to the newest metrics entry ``store``
    holds; ``reader`` then starts after it."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    newest = store.latest_metrics(1)
    last = stream_order(newest[0][0]) if newest else (0, 0)
    kept = [row for row in rows if stream_order(row.get("stream_id") or "0-0") <= last]
    sink = CsvSink(path.open("w", newline=""), header)
    sink.write([{column: row.get(column, "") for column in header} for row in kept])
    sink.flush()
    if kept:
        reader.last_id = kept[-1]["stream_id"]
    return sink


def stream_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (milliseconds-sequence) as a pair that sorts as Redis orders it."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
