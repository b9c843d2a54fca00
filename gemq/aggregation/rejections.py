"""The reasons the aggregator refuses a gradient the decoder accepted, and what it does with
refused gradients beyond counting them: logs them without flooding, and fails a run that
refuses everything instead of letting it spin.

Counting happens in the commit window (gemq/aggregation/window.py). A refusal is a
``gemq.wire.codec.CodecError`` whose reason is one of the decoder's (codec.REASONS) or one
of REASONS here; each reason is a counter in Redis (``rejected:<reason>``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from gemq.wire import codec

log = logging.getLogger(__name__)

# The aggregator's own reasons. A message computed on a version more than max_staleness
# updates old, or on one the run never published:
TOO_STALE = "too_stale"
FUTURE_VERSION = "future_version"
# ...within max_staleness, but its snapshot was dropped by the byte budget:
SNAPSHOT_GONE = "snapshot_gone"
# ...and two from the stream entry itself: its sender field (gemq.state.keys.SENDER_FIELD)
# is missing, not a valid worker id or not the header's; or names a worker that never
# registered.
BAD_SENDER = "bad_sender"
UNKNOWN_SENDER = "unknown_sender"
REASONS = (TOO_STALE, FUTURE_VERSION, SNAPSHOT_GONE, BAD_SENDER, UNKNOWN_SENDER)

#: What usually causes each reason, for the message of a run that stalled on it.
HINTS = {
    codec.OUT_OF_RANGE: "gradient elements beyond 1e12: usually a loss that does not fit "
                        "the model (a model that outputs logits trained with --loss nll), "
                        "or a learning rate high enough to make it diverge",
    codec.NON_FINITE: "NaN or infinite gradients: the model diverged (try a lower --lr) or "
                      "its loss is undefined on some inputs",
    TOO_STALE: "gradients computed on parameters older than --max-staleness updates: "
                     "raise --max-staleness or use fewer workers",
    SNAPSHOT_GONE: "gradients on parameters older than the snapshots kept: raise "
                         "--snapshot-budget-mb (or --shards, so each shard's snapshots are "
                         "smaller) or use fewer workers",
    FUTURE_VERSION: "gradients on parameters this run never published: workers of "
                          "another run with the same id, or a run restored from an older "
                          "copy of Redis",
    codec.WRONG_LAYOUT: "workers run a different model than the run's (another --model, or "
                        "another version of a module:factory)",
    codec.WRONG_RUN: "workers publish gradients of another run into this run's stream",
    codec.WRONG_DTYPE: "workers send another wire dtype than the run's --wire-dtype",
    BAD_SENDER: "stream entries without a valid sender: something other than gemq's "
                      "workers writes to the gradient stream",
    UNKNOWN_SENDER: "gradients from senders that never registered with the run: "
                          "something other than gemq's workers writes to the stream",
}
#: Reasons whose cause is a foreign writer or a version mismatch, not the training itself.
_FOREIGN = ("entries that are not gemq gradients of this version: something other than "
            "gemq's workers writes to the gradient stream, or workers of another gemq "
            "version")
#: Rejections logged one by one per (worker, reason) before only summaries are written.
LOGGED_PAIRS = 50
#: Seconds between two summary lines of the rejections not logged one by one.
SUMMARY_EVERY_S = 30.0


def hint(reason: str) -> str:
    return HINTS.get(reason, _FOREIGN)


class RejectionLog:
    """One line for the first rejection of each (worker, reason), for the first
    LOGGED_PAIRS pairs; after that, a summary line at most every SUMMARY_EVERY_S. Junk
    from many senders costs a few lines, not one per sender."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._pairs: set[tuple[str, str]] = set()
        self._unlogged: Counter[str] = Counter()
        self._summary_at = time.monotonic()

    def rejected(self, worker_id: str, error: codec.CodecError) -> None:
        pair = (worker_id, error.reason)
        if pair in self._pairs:
            return
        if len(self._pairs) < LOGGED_PAIRS:
            self._pairs.add(pair)
            log.warning("run %s: rejected a gradient from %s: %s (logged once per worker and "
                        "reason)", self.run_id, worker_id, error)
            return
        self._unlogged[error.reason] += 1
        now = time.monotonic()
        if now - self._summary_at >= SUMMARY_EVERY_S:
            self._summary_at = now
            counts = ", ".join(f"{n} {r}" for r, n in self._unlogged.most_common())
            log.warning("run %s: rejected %s more gradients from other senders (not logged "
                        "one by one)", self.run_id, counts)
            self._unlogged.clear()


class StallWatch:
    """Tells when a run has stalled: ``max_in_a_row`` gradients rejected in a row, or none
    applied for ``timeout_s`` while gradients kept being rejected (the last one in the
    second half of that time). A run nobody sends gradients to is waiting, not stalled."""

    def __init__(self, max_in_a_row: int, timeout_s: float) -> None:
        self.max_in_a_row = max_in_a_row
        self.timeout_s = timeout_s
        self._reasons: Counter[str] = Counter()
        self._in_a_row = 0
        self._first_rejected_at: float | None = None
        self._last_rejected_at = 0.0

    def applied(self) -> None:
        self._reasons.clear()
        self._in_a_row = 0
        self._first_rejected_at = None

    def rejected(self, reason: str) -> None:
        self._reasons[reason] += 1
        self._in_a_row += 1
        self._last_rejected_at = time.monotonic()
        if self._first_rejected_at is None:
            self._first_rejected_at = self._last_rejected_at

    def stalled(self) -> str | None:
        """None, or why the run cannot make progress (the run's error message)."""
        if not self._reasons:
            return None
        now = time.monotonic()
        waited = now - (self._first_rejected_at or now)
        still_coming = now - self._last_rejected_at <= self.timeout_s / 2
        if self._in_a_row >= self.max_in_a_row:
            what = f"{self._in_a_row} gradients in a row were rejected"
        elif waited >= self.timeout_s and still_coming:
            what = (f"no update was applied for {waited:.0f}s while {self._in_a_row} "
                    "gradients were rejected")
        else:
            return None
        reason, count = self._reasons.most_common(1)[0]
        return (f"{what}, {count} of them as {reason}: {hint(reason)} (limits: "
                f"--max-rejected-in-a-row {self.max_in_a_row}, --stall-timeout-s "
                f"{self.timeout_s:g})")
