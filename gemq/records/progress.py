"""Live progress of a run on the terminal, read from the run's metrics stream and its
rejections (every shard's). A sharded run's bar and numbers are the run's: its slowest
shard's updates, its shards' energies summed, their mean staleness and the range of their
median pi (gemq/records/combine.py); the loss is shard 0's rows' (every slice carries its
step's)."""

from __future__ import annotations

import math
import sys
from typing import Any

from tqdm import tqdm

from gemq.records import combine
from gemq.state.store import RunStore


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
        self.overall: dict[str, Any] = {}  # a sharded run's run-wide numbers
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
        for _, row in rows:
            loss = float(row["loss"])
            self.loss = loss if math.isnan(self.loss) else 0.9 * self.loss + 0.1 * loss
        if rows:
            self.last_id, self.last = rows[-1]
        updates = int(self.last["updates"]) if self.last else 0
        if len(self.shards) > 1:  # the run's numbers: every shard moves at its own pace
            table = combine.shard_table(self.shards)
            self.overall = combine.overall(table)
            updates = min(shard["updates"] for shard in table)
        if updates == (self.bar.n if self.bar else 0) and rejected == self.rejected:
            return
        self.bar = self.bar or self._open()
        self.rejected = rejected
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        if updates != self.bar.n:
            self.bar.update(updates - self.bar.n)
        else:
            self.bar.refresh()

    def _postfix(self) -> str:
        last = self.last
        text = (f"loss={self.loss:.3f} {self._gem_numbers()} "
                f"workers={last['active_workers']}" if last else "")
        if self.rejected:
            total = sum(self.rejected.values())
            reason = max(self.rejected, key=lambda r: self.rejected[r])
            text += f" rejected={total} ({reason})"
        return text.strip()

    def _gem_numbers(self) -> str:
        """Energy ratio, mean staleness and median pi, named as in metrics.csv and the
        README's "Reading the numbers": the run's, for a sharded run."""
        if len(self.shards) == 1:
            last = self.last
            return (f"energy_ratio={float(last['energy_ratio']):.2f} "
                    f"staleness={float(last['staleness_mean']):.1f} "
                    f"median_pi={float(last['median_pi']):.2f}")
        overall = self.overall
        pis = overall.get("median_pi_range")
        return (f"energy_ratio={_shown(overall.get('energy_ratio'), '.2f')} "
                f"staleness={_shown(overall.get('staleness_mean'), '.1f')} "
                f"median_pi={f'{pis[0]:.2f}-{pis[1]:.2f}' if pis else '-'}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _shown(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rejections(counters: dict[str, int]) -> dict[str, int]:
    return {k.removeprefix("rejected:"): v for k, v in counters.items()
            if k.startswith("rejected:") and v}
