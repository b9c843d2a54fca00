"""A run's curves read back from Redis (``gemq export``, the API's CSV download): every row
its metrics stream holds, in a file format of gemq.records.curves."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import IO

from tqdm import tqdm

from gemq.errors import GemqError
from gemq.records.curves import CurveReader, file_sink
from gemq.state.store import RunStore


def export_curves(store: RunStore, out: IO[str], fmt: str, progress: bool = False) -> int:
    """Write the run's rows to ``out`` as ``fmt`` (csv or jsonl); return how many were
    written. Raises RunNotFound, before anything is written, for an unknown run.

    ``progress``: a counter on stderr, if it is a terminal, for an export that takes over
    a second (a run's stream holds up to METRICS_MAXLEN entries; a distant Redis serves
    them a page at a time)."""
    reader = CurveReader(store)
    sink = file_sink(out, fmt, reader.rows.columns)
    written = 0
    # disable=None: tqdm stays quiet where stderr is not a terminal (logs, pipes).
    with tqdm(unit=" rows", file=sys.stderr, delay=1.0, disable=None if progress else True,
              desc=f"export {store.run_id}") as bar:
        for rows in reader.pages():
            sink.write(rows)
            written += len(rows)
            bar.update(len(rows))
    sink.flush()
    return written


def export_to_file(store: RunStore, path: Path, fmt: str, progress: bool = False) -> int:
    """``export_curves`` into ``path``, which appears only once complete: an export that
    fails leaves no half-written file."""
    partial = path.with_name(path.name + ".partial")
    try:
        out = partial.open("w", newline="")
    except OSError as e:
        raise GemqError(f"cannot write {path}: {e.strerror}") from e
    try:
        with out:
            written = export_curves(store, out, fmt, progress)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return written


def export_to_stdout(store: RunStore, fmt: str, progress: bool = False) -> int:
    """``export_curves`` to standard output; a reader that stops early (``| head``) ends
    the export quietly."""
    try:
        written = export_curves(store, sys.stdout, fmt, progress)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point it elsewhere.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return written
