"""A local run's model file: the newest published state as a torch state_dict.

``gemq run`` writes it now and then while the run goes (so that a crash of the machine
leaves a recent model), when it is interrupted (Ctrl-C, SIGTERM, a failure) and at its end.
Writes are atomic (gemq.training.evaluate.save_state_dict): a reader never sees half a file.
They go through the run's folder (gemq.records.runfolder): one the disk refuses costs
neither the training nor the model.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from torch import nn

from gemq.errors import GemqError
from gemq.records import combine
from gemq.records.runfolder import RunFolder
from gemq.state.store import RunStore
from gemq.training.evaluate import save_state_dict
from gemq.training.flatmodel import load_flat

log = logging.getLogger(__name__)

#: Seconds between two periodic writes during a run.
SAVE_EVERY_S = 60.0
MODEL_FILE = "model.pt"


class ModelFile:
    """Writes ``store``'s newest state, loaded into ``model``, to ``folder``'s model.pt."""

    def __init__(self, store: RunStore, model: nn.Module, folder: RunFolder,
                 every_s: float = SAVE_EVERY_S) -> None:
        self.store, self.model, self.folder, self.every_s = store, model, folder, every_s
        self.versions: tuple[int, ...] = ()
        self._saved_at = time.monotonic()
        self._failed = False

    @property
    def path(self) -> Path:
        return self.folder.file(MODEL_FILE)

    def save(self) -> int:
        """Write the newest published state (every shard's); return its version (the
        slowest shard's)."""
        versions, state = combine.latest_state(self.store.shards())
        if versions != self.versions or not self.path.exists():  # removed: again
            load_flat(self.model, state)
            self.folder.write(MODEL_FILE, lambda path: save_state_dict(self.model, path))
            self.versions = versions
        self._saved_at = time.monotonic()
        return min(versions)

    def save_if_due(self) -> None:
        """A periodic write; one that no folder takes is said once, and the run goes on
        (the state is in Redis, and the final write tries again)."""
        if time.monotonic() - self._saved_at < self.every_s:
            return
        try:
            self.save()
        except GemqError as e:
            self._saved_at = time.monotonic()
            if not self._failed:
                log.warning("%s; the run goes on, and tries again at its end", e)
            self._failed = True

    def save_on_the_way_out(self) -> None:
        """Best effort, for an interrupted run: say where the model is, or why not."""
        try:
            version = self.save()
        except Exception as e:  # Redis may be gone already; the original error matters more
            log.warning("could not save the model on the way out: %s", e)
            return
        log.warning("saved the model as of update %d to %s", version, self.path)
