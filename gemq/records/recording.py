"""A local run's curves, written while it runs: ``metrics.csv`` beside the model, and
TensorBoard scalars where asked for. Rows are flushed at every poll, so a run that is killed
leaves its curves up to its last poll."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

from gemq.records.curves import CsvSink, CurveReader, CurveSink
from gemq.state.store import RunStore


class CurveRecorder:
    """Follows a run's metrics stream and appends each new entry to its sinks."""

    def __init__(self, store: RunStore, path: Path, tensorboard: Path | None = None) -> None:
        self.reader = CurveReader(store)
        header = self.reader.rows.columns
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks: list[CurveSink] = [CsvSink(path.open("w", newline=""), header)]
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
