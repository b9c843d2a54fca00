"""Live progress of a run on the terminal, read from the run's metrics stream (shard 0's,
for a sharded run) and its rejections (every shard's)."""

from __future__ import annotations

import math
import sys

from tqdm import tqdm

from gemq import combine
from gemq.store import RunStore


class ProgressDisplay:
    """A tqdm bar over updates applied, with loss, energy ratio and staleness beside it."""

    def __init__(self, store: RunStore, total: int, enabled: bool = True,
                 starting: str = "") -> None:
        self.store = store
        self.shards = store.shards()
        self.total = total
        self.enabled = enabled
        self.last_id = "0-0"
        self.loss = math.nan
        self.last: dict[str, str] = {}
        self.rejected: dict[str, int] = {}
        self.bar: tqdm | None = None  # opened at the first update, so the rate is honest
        if enabled and starting:
            print(starting, file=sys.stderr, flush=True)

    def _open(self) -> tqdm:
        return tqdm(total=self.total, unit="upd", dynamic_ncols=True, file=sys.stderr,
                    desc=self.store.run_id, smoothing=0.1,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                               "[{elapsed}<{remaining}, {rate_fmt}] {postfix}")

    def poll(self) -> None:
        """Advance the bar by what was committed since the last poll; show rejections as
        they happen (a run that rejects everything commits no metrics row)."""
        if not self.enabled:
            return
        rows = self.store.metrics_since(self.last_id)
        rejected = _rejections(combine.counters(self.shards))
        if not rows and rejected == self.rejected:
            return
        self.bar = self.bar or self._open()
        self.rejected = rejected
        if rows:
            self.last_id = rows[-1][0]
            self.last = rows[-1][1]
        for _, row in rows:
            loss = float(row["loss"])
            self.loss = loss if math.isnan(self.loss) else 0.9 * self.loss + 0.1 * loss
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        if rows:
            self.bar.update(int(self.last["updates"]) - self.bar.n)
        else:
            self.bar.refresh()

    def _postfix(self) -> str:
        last = self.last
        text = (f"loss={self.loss:.3f} energy={float(last['energy_ratio']):.2f} "
                f"tau={float(last['staleness_mean']):.1f} pi={float(last['median_pi']):.2f} "
                f"workers={last['active_workers']}" if last else "")
        if self.rejected:
            total = sum(self.rejected.values())
            reason = max(self.rejected, key=lambda r: self.rejected[r])
            text += f" rejected={total} ({reason})"
        return text.strip()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _rejections(counters: dict[str, int]) -> dict[str, int]:
    return {k.removeprefix("rejected:"): v for k, v in counters.items()
            if k.startswith("rejected:") and v}
