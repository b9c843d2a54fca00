"""The folder that receives a local run's results, and what happens when it fails mid-run.

Nothing on the local disk may cost the training. A run writes its results (config.toml,
metrics.csv, model.pt, summary.json) through a ``RunFolder``:

- a folder removed while the run trains is made again at the next write
  (``gemq.records.curvefile`` writes metrics.csv again in full);
- a folder that refuses a write (a full disk, a folder turned read-only) is left: the
  results go on in a folder of their own under the system's temporary directory, which one
  warning line names, and the results written so far are copied there. summary.json then
  names where the model and the curves are.

Only when that folder refuses a write too is it an error, and then one line.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gemq.errors import GemqError

log = logging.getLogger(__name__)

T = TypeVar("T")


class RunFolder:
    """Where a run's results go now: ``path``, until a write there fails."""

    def __init__(self, path: Path, run_id: str, results: tuple[str, ...]) -> None:
        """``results``: the names of the files to copy along if the folder has to move."""
        self.path, self.run_id, self.results = path, run_id, results
        #: The folder left, once a write there failed (None: none has).
        self.left: Path | None = None

    def file(self, name: str) -> Path:
        return self.path / name

    def write(self, name: str, writer: Callable[[Path], T]) -> T:
        """``writer(path)`` for the file ``name``, in the folder made again if it was
        removed, or in the fallback folder if the run's folder refuses it."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            return writer(self.path / name)
        except OSError as e:
            self.leave(name, e)
        try:
            return writer(self.path / name)
        except OSError as e:
            raise GemqError(f"cannot write {name} in {self.path} either: "
                            f"{e.strerror or e}") from e

    def leave(self, name: str, error: OSError) -> None:
        """Writing ``name`` here failed with ``error``: move to the fallback folder, or
        raise GemqError if this is the fallback folder already."""
        if self.left is not None:
            raise GemqError(f"cannot write {name} in {self.path}, where the run's results "
                            f"went when {self.left} refused them: "
                            f"{error.strerror or error}") from error
        try:
            fallback = Path(tempfile.mkdtemp(prefix=f"gemq-{self.run_id}-"))
        except OSError as e:
            raise GemqError(f"cannot write {name} in {self.path} ({error.strerror or error}),"
                            f" nor make a folder for the run's results under "
                            f"{tempfile.gettempdir()}: {e.strerror or e}") from e
        copied = [name for name in self.results if _copied(self.path / name, fallback / name)]
        log.warning("cannot write %s in %s (%s): the run's results go to %s instead%s",
                    name, self.path, error.strerror or error, fallback,
                    f" ({', '.join(copied)} copied there)" if copied else "")
        self.left, self.path = self.path, fallback


def _copied(source: Path, target: Path) -> bool:
    """Copy ``source`` if it can be read; whether it was."""
    try:
        shutil.copyfile(source, target)
    except OSError:
        return False
    return True
