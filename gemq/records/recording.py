"""A local run's curves, written while it runs: ``metrics.csv`` beside the model, and
TensorBoard scalars where asked for. Rows are flushed at every poll, so a run that is killed
leaves its curves up to its last poll."""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from gemq.records.curvefile import CurveFile
from gemq.records.curves import CURVES_FILE, CurveReader, CurveSink, Row
from gemq.records.runfolder import RunFolder
from gemq.state.store import RunStore

log = logging.getLogger(__name__)


class CurveRecorder:
    """Follows a run's metrics stream and appends each new entry to its sinks."""

    def __init__(self, store: RunStore, folder: RunFolder, tensorboard: Path | None = None, *,
                 append: bool = False) -> None:
        """``append``: the run is resumed, and ``folder`` holds its curves so far: rows past
        the run's restored metrics (written after its last saved state) are dropped, and
        the new ones follow."""
        self.reader = CurveReader(store)
        header = self.reader.rows.columns
        kept = _kept_rows(folder.file(CURVES_FILE), header, store) if append else []
        if kept:
            self.reader.last_id = str(kept[-1]["stream_id"])
        self.sinks: list[CurveSink] = [CurveFile(folder, header, kept)]
        if tensorboard is not None:
            from gemq.records.tensorboard_curves import TensorBoardSink

            # One folder per run: `tensorboard --logdir DIR` then compares runs.
            self.sinks.append(TensorBoardSink(tensorboard / store.run_id, header))

    def poll(self) -> None:
        """Write what was committed since the last poll, and flush it."""
        rows = [row for page in self.reader.pages() for row in page]
        if rows:
            self._each_sink(lambda sink: sink.write(rows))
            self._each_sink(lambda sink: sink.flush())

    def close(self) -> None:
        self._each_sink(lambda sink: sink.close())

    def _each_sink(self, do: Callable[[CurveSink], None]) -> None:
        """Do ``do`` to each sink; a sink that fails with an OSError (TensorBoard's folder
        full, say) is dropped with a warning: the run and its other curves go on. The
        metrics.csv sink does not fail so: it finds another place (gemq.records.curvefile).
        """
        for sink in list(self.sinks):
            try:
                do(sink)
            except OSError as e:
                log.warning("%s stops: %s; the run goes on", type(sink).__name__, e)
                self.sinks.remove(sink)

    def __enter__(self) -> CurveRecorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _kept_rows(path: Path, header: list[str], store: RunStore) -> list[Row]:
    """``path``'s rows up to the newest metrics entry ``store`` holds (none if it cannot
    be read)."""
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        log.warning("cannot read the run's curves so far from %s (%s): metrics.csv starts "
                    "again from the resumed state", path, e.strerror or e)
        return []
    newest = store.latest_metrics(1)
    last = stream_order(newest[0][0]) if newest else (0, 0)
    return [{column: row.get(column, "") for column in header} for row in rows
            if stream_order(row.get("stream_id") or "0-0") <= last]


def stream_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (milliseconds-sequence) as a pair that sorts as Redis orders it."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
