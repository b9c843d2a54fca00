"""`gemq run`'s live progress line: the run's numbers, a sharded run's combined."""

from __future__ import annotations

import pytest
import redis

from gemq.records import combine
from gemq.records.progress import ProgressDisplay
from gemq.state.store import RunStore
from tests.test_shards import lockstep


def test_a_run_of_one_shard_shows_its_latest_rows_numbers(redis_client: redis.Redis,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    lockstep(redis_client, "bar-one", 8, algo="gem")
    store = RunStore(redis_client, "bar-one")
    progress = ProgressDisplay(store, 9)
    progress.poll()
    (_, row), = store.latest_metrics(1)
    assert progress.bar is not None and progress.bar.n == 8
    assert progress._postfix() == (
        f"loss={progress.loss:.3f} energy_ratio={float(row['energy_ratio']):.2f} "
        f"staleness={float(row['staleness_mean']):.1f} median_pi={float(row['median_pi']):.2f} "
        "workers=1")
    progress.close()
    assert "8/9" in capsys.readouterr().err


def test_a_sharded_runs_bar_is_its_slowest_shard_and_its_energies_are_summed(
        redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    lockstep(redis_client, "bar-three", 10, behind=3, algo="gem", shards=3)
    store = RunStore(redis_client, "bar-three")
    progress = ProgressDisplay(store, 11)
    progress.poll()
    table = combine.shard_table(store.shards())
    assert [shard["updates"] for shard in table] == [10, 10, 7]
    assert progress.bar is not None and progress.bar.n == 7  # the run's: its slowest shard
    overall = combine.overall(table)
    low, high = overall["median_pi_range"]
    numbers = (f"energy_ratio={overall['energy_ratio']:.2f} "
               f"staleness={overall['staleness_mean']:.1f} median_pi={low:.2f}-{high:.2f}")
    assert progress._postfix() == f"loss={progress.loss:.3f} {numbers} workers=1"
    assert f"{table[0]['energy_ratio']:.2f}" != f"{overall['energy_ratio']:.2f}"  # not shard 0's
    progress.close()
    assert "7/11" in capsys.readouterr().err
