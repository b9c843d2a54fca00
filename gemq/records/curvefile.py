"""A local run's ``metrics.csv``, written so that the disk cannot cost the run.

The file is written through the run's folder (gemq.records.runfolder) and keeps track of
the bytes it knows were written whole, and of the rows not yet flushed. Whenever the file
is no longer where the folder says (a failed write, the file or its folder removed, the
folder moved elsewhere after a failure), it is written again where the folder now is:
those whole bytes, read back through the open file, then the rows not yet flushed. No row
is lost and none is written twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from gemq.errors import GemqError
from gemq.records.curves import CURVES_FILE, Row, csv_text
from gemq.records.runfolder import RunFolder

log = logging.getLogger(__name__)


class CurveFile:
    """``metrics.csv`` in ``folder``: a CurveSink."""

    def __init__(self, folder: RunFolder, header: Sequence[str],
                 rows: Sequence[Row] = ()) -> None:
        """``rows``: the rows it starts with (a resumed run's curves so far)."""
        self.folder, self.header = folder, list(header)
        self._pending: list[Row] = list(rows)
        self._file: BinaryIO | None = None
        self._folder = folder.path  # where the open file is
        self._whole = 0  # bytes of the file known written and flushed, header included
        self._stopped = False
        self._open(b"")

    def write(self, rows: Sequence[Row]) -> None:
        self._pending.extend(rows)

    def flush(self) -> None:
        if self._stopped:
            return
        if self._file is None or self._moved():
            self._open(self._written())
            return
        text = csv_text(self.header, self._pending).encode()
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as e:  # the folder refuses it: the results go elsewhere
            written = self._written()
            try:
                self.folder.leave(CURVES_FILE, e)
            except GemqError as error:
                self._stop(error)
                return
            self._open(written)
            return
        self._whole += len(text)
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            with contextlib.suppress(OSError):  # what matters was flushed
                self._file.close()

    @property
    def path(self) -> Path:
        return self.folder.file(CURVES_FILE)

    def _moved(self) -> bool:
        """Whether the file is no longer the one the folder names: the folder moved, or
        the file was removed (alone or with its folder), which it says."""
        assert self._file is not None
        if self.folder.path != self._folder:
            return True
        try:
            mine, there = os.fstat(self._file.fileno()), os.stat(self.path)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                return False
        except OSError:
            pass
        log.warning("%s was removed while the run trained: it is written again in full",
                    self.path)
        return True

    def _written(self) -> bytes:
        """The whole bytes written so far, read back through the open file."""
        if self._file is None:
            return b""
        try:
            return os.pread(self._file.fileno(), self._whole, 0)
        finally:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _open(self, written: bytes) -> None:
        """Write the file anew where the folder is now: ``written`` (or the header), then
        the rows not yet flushed; keep it open for more."""
        content = (written or csv_text(self.header, [], with_header=True).encode()) + \
            csv_text(self.header, self._pending).encode()
        try:
            self._file = self.folder.write(CURVES_FILE, lambda path: _filled(path, content))
        except GemqError as e:
            self._stop(e)
            return
        self._folder = self.folder.path
        self._whole = len(content)
        self._pending.clear()

    def _stop(self, error: GemqError) -> None:
        log.warning("%s; the curves are no longer written to disk (the run goes on)", error)
        self._stopped = True


def _filled(path: Path, content: bytes) -> BinaryIO:
    """``path`` made to hold ``content``, open for appending more (and reading back)."""
    file = path.open("w+b")
    try:
        file.write(content)
        file.flush()
    except BaseException:
        file.close()
        raise
    return file
