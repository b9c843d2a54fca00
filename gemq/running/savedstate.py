"""A local run's whole state on disk, so that ``gemq run --resume`` continues it.

The private Redis of ``gemq run`` keeps its data in the run's folder (``<out>/redis/``)
instead of a temporary one, and writes it there as an RDB file (``state.rdb``, Redis' own
snapshot format) whenever the run could be cut short:

- now and then while the run trains (BGSAVE: a forked child writes a consistent snapshot
  while Redis goes on), as often as costs at most ``BGSAVE_OVERHEAD`` of the time;
- when ``gemq run`` is interrupted (Ctrl-C, SIGTERM, SIGHUP), with a SAVE once its
  processes have stopped;
- when ``gemq run`` dies outright (SIGKILL, a crash): Redis gets SIGTERM as its owner dies
  (gemq.running.embedded) and is set to save on SIGTERM.

A snapshot is the run as Redis holds it: parameters and update count, the GEM moments
(as of their last checkpoint: gemq.aggregation.checkpoints), counters, the gradients
still queued and their snapshots, the worker table, the metrics. Starting a Redis on it
and an aggregator on the run is the aggregator's restart after a crash: the same code,
the same guarantees (docs/design.md).

A run that ends (finished, stopped, failed) cannot be continued: its folder keeps no
state, only its results.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

import redis

from gemq.errors import GemqError
from gemq.running.embedded import EmbeddedRedis

log = logging.getLogger(__name__)

STATE_DIR, STATE_FILE = "redis", "state.rdb"
#: The periodic snapshots: at most this share of the time goes to writing them (the wait
#: after one is its cost divided by this share), and none sooner than BGSAVE_EVERY_S after
#: the last.
BGSAVE_OVERHEAD = 0.05
BGSAVE_EVERY_S = 60.0
#: Redis 7 saves on SIGTERM when told to (``shutdown-on-sigterm``); Redis 6 when it has a
#: save point, and this one never comes due by time.
SAVE_ON_SIGTERM_7 = "save force"
SAVE_POINT_6 = "31536000 1"


def state_file(out: Path) -> Path:
    return out / STATE_DIR / STATE_FILE


class SavedState:
    """The private Redis of the run whose folder is ``out``, and its state file."""

    def __init__(self, out: Path) -> None:
        self.directory = out / STATE_DIR
        self.file = state_file(out)
        self._next_bgsave = time.monotonic() + BGSAVE_EVERY_S
        self._warned = False
        self.armed = self.discarded = False
        self.resumed = self.file.exists()  # a state to keep whatever happens next

    def server(self) -> EmbeddedRedis:
        """The private redis-server, on this folder: it loads the state file if there is
        one. A snapshot that fails to write (a full disk) never stops it taking writes."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GemqError(f"cannot write the run's folder {self.directory.parent}: "
                            f"{e.strerror or e}") from e
        return EmbeddedRedis(directory=self.directory, die_with_owner=True,
                             extra_args=("--dbfilename", STATE_FILE,
                                         "--stop-writes-on-bgsave-error", "no"))

    def arm(self, client: redis.Redis) -> None:
        """From now on the server saves the state when it is stopped or its owner dies."""
        try:
            client.config_set("shutdown-on-sigterm", SAVE_ON_SIGTERM_7)
        except redis.ResponseError:  # Redis 6: no such setting
            client.config_set("save", SAVE_POINT_6)
        self.armed = True

    def save_if_due(self, client: redis.Redis) -> None:
        """Start a snapshot in the background if one is due and none is being written."""
        now = time.monotonic()
        if now < self._next_bgsave:
            return
        persistence = client.info("persistence")
        if int(persistence.get("rdb_bgsave_in_progress", 0)):
            return
        if persistence.get("rdb_last_bgsave_status", "ok") != "ok" and not self._warned:
            self._warned = True
            log.warning("could not write the run's state to %s (see %s); it goes on "
                        "training, but an interruption now could not be resumed",
                        self.file, self.directory / "redis.log")
        try:
            client.bgsave()
        except redis.ResponseError as e:  # a save started in between: the next time
            log.debug("BGSAVE refused: %s", e)
        cost_s = max(0, int(persistence.get("rdb_last_bgsave_time_sec", 0)))
        self._next_bgsave = now + max(BGSAVE_EVERY_S, cost_s / BGSAVE_OVERHEAD)

    def keep(self, url: str) -> bool:
        """Write the state now (the run's processes have stopped); False if it could not
        be written. The server then stops without writing it a second time."""
        try:
            with redis.Redis.from_url(url, socket_timeout=None) as client:
                client.save()
                self._disarm(client)
        except redis.RedisError as e:
            log.warning("could not save the run's state to %s: %s", self.file, e)
            return False
        return True

    def discard(self, client: redis.Redis) -> None:
        """The run has ended: the server stops without saving and ``remove`` clears the
        folder."""
        self._disarm(client)
        self.discarded = True

    def remove(self) -> None:
        """After the server has stopped: the folder goes, unless it holds the state of a
        run that trained (or was resumed) and did not end."""
        if (self.armed or self.resumed) and not self.discarded:
            return
        shutil.rmtree(self.directory, ignore_errors=True)

    @staticmethod
    def _disarm(client: redis.Redis) -> None:
        client.config_set("save", "")
        with contextlib.suppress(redis.ResponseError):  # Redis 6 has no such setting
            client.config_set("shutdown-on-sigterm", "default")
