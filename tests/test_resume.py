"""``gemq run --resume``: an interrupted run goes on with its whole state, as a user runs it
(subprocesses, signals to the process group or to ``gemq run`` alone)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from gemq.records.curves import CsvSink, CurveReader
from gemq.records.recording import CurveRecorder
from gemq.records.runfolder import RunFolder
from gemq.running.embedded import EmbeddedRedis
from gemq.running.savedstate import SavedState, state_file
from gemq.state.store import RunState, RunStore
from tests.helpers import GemqProcess, session, small_run, wait_for

SMALL = ("--model", "logreg", "--dataset", "digits", "--workers", "2", "--no-progress")


def _gemq(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gemq", *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def _last_update(metrics: Path) -> int:
    """The update count of the newest whole row of a run's metrics.csv (0: none yet)."""
    if not metrics.exists():
        return 0
    lines = [line for line in metrics.read_text().splitlines()[1:] if line]
    return int(lines[-1].split(",")[2]) if lines else 0


def _curve(metrics: Path) -> list[dict[str, str]]:
    with metrics.open(newline="") as f:
        return list(csv.DictReader(f))


def _assert_one_curve(rows: list[dict[str, str]], resumed_after: int, end: int) -> None:
    """metrics.csv is one curve from the start to ``end``: no row twice, none out of order,
    and the resumed part follows the update the state was saved at."""
    updates = [int(row["updates"]) for row in rows]
    ids = [tuple(int(part) for part in row["stream_id"].split("-")) for row in rows]
    assert updates[0] < 50 and updates[-1] == end
    assert all(b > a for a, b in zip(updates, updates[1:], strict=False))
    assert all(b > a for a, b in zip(ids, ids[1:], strict=False))
    after = next(u for u in updates if u > resumed_after)
    assert after <= resumed_after + 50, (resumed_after, after)


def _interrupt(process: GemqProcess, signum: int) -> str:
    """Ctrl-C as a terminal sends it (the whole process group), or SIGKILL to gemq run
    alone (a crash: no handler of its own runs)."""
    if signum == signal.SIGKILL:
        process.process.kill()
    else:
        os.killpg(process.process.pid, signum)
    code = process.wait(timeout=120)
    assert code == (-signal.SIGKILL if signum == signal.SIGKILL else 130), process.output()
    return process.output()


def _saved_run(out: Path, run_id: str) -> tuple[int, dict[str, np.ndarray], dict[str, int]]:
    """What the folder's saved state holds of the run: its version, checkpointed GEM
    moments and counters (read from a redis-server started on it, as --resume does)."""
    with SavedState(out).server() as server, redis.Redis.from_url(server.url) as client:
        store = RunStore(client, run_id)
        assert store.state() == RunState.RUNNING
        _, moments = store.checkpointed_moments()
        return store.head().version, moments, store.counters()


@pytest.mark.slow
def test_ctrl_c_then_resume_goes_on_with_the_whole_state(tmp_path: Path) -> None:
    out = tmp_path / "r"
    first = GemqProcess("run", *SMALL, "--steps", "4000", "--run", "r", "--out", str(out))
    try:
        wait_for(lambda: _last_update(out / "metrics.csv") >= 1000, timeout_s=300,
                 what="1000 updates")
        output = _interrupt(first, signal.SIGINT)
    finally:
        first.stop()
    assert f"continue it with gemq run --resume {out}" in output
    version, moments, counters = _saved_run(out, "r")
    assert version >= 1000
    assert counters["applied"] == version
    assert sorted(moments) == ["r-w0", "r-w1"]  # GEM's state for each worker...
    assert all(np.any(moment) for moment in moments.values())  # ...not zeros

    refused = _gemq("run", *SMALL, "--steps", "4000", "--run", "r", "--out", str(out))
    assert refused.returncode == 1
    assert f"gemq run --resume {out}" in refused.stderr.strip().splitlines()[-1]
    changed = _gemq("run", "--resume", str(out), "--lr", "0.5", "--no-progress")
    assert changed.returncode == 2
    assert "drop --lr" in changed.stderr and len(changed.stderr.strip().splitlines()) == 1

    summary_path = tmp_path / "summary.json"
    resumed = _gemq("run", "--resume", str(out), "--workers", "3", "--no-progress",
                    "--json", str(summary_path))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    assert summary["state"] == "finished"
    assert summary["updates_applied"] == 4000  # the budget, counted from the run's start
    assert summary["test_accuracy"] > 0.85
    assert not state_file(out).parent.exists()  # an ended run keeps no state
    rows = _curve(out / "metrics.csv")
    _assert_one_curve(rows, version, 4000)
    # Held-out evaluations every 200 updates (the default), before and after the resume.
    evaluated = [(int(row["eval_updates"]), float(row["test_accuracy"])) for row in rows
                 if row["eval_updates"]]
    assert [u // 200 for u, _ in evaluated] == list(range(1, 20)), evaluated
    assert abs(evaluated[-1][1] - summary["test_accuracy"]) < 0.05  # digits: 360 held out

    again = _gemq("run", "--resume", str(out), "--no-progress")
    assert again.returncode == 1
    assert "has ended" in again.stderr and "--init-from" in again.stderr


@pytest.mark.slow
def test_a_killed_gemq_run_resumes_from_the_state_its_redis_wrote(tmp_path: Path) -> None:
    """SIGKILL leaves gemq run no moment to save anything: its private Redis, told of its
    owner's death, writes the state as it stops."""
    out = tmp_path / "k"
    first = GemqProcess("run", *SMALL, "--steps", "3000", "--run", "k", "--out", str(out))
    try:
        wait_for(lambda: _last_update(out / "metrics.csv") >= 800, timeout_s=300,
                 what="800 updates")
        _interrupt(first, signal.SIGKILL)
        wait_for(lambda: not session(first.process.pid), timeout_s=120,
                 what="the killed run's processes to stop")
    finally:
        first.stop()
    version, _, _ = _saved_run(out, "k")
    assert version >= 800
    resumed = _gemq("run", "--resume", str(out), "--workers", "1", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "updates: 3000 applied" in resumed.stdout
    assert "joined from elsewhere" not in resumed.stdout  # the run's own earlier workers
    _assert_one_curve(_curve(out / "metrics.csv"), version, 3000)


@pytest.mark.slow
def test_a_run_on_a_redis_url_resumes_by_its_id(
        tmp_path: Path, redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    out = tmp_path / "u"
    store = RunStore(redis_client, "u")
    first = GemqProcess("run", *SMALL, "--steps", "3000", "--run", "u", "--out", str(out),
                        "--redis-url", redis_server.url)
    try:
        wait_for(lambda: store.exists() and store.counters().get("applied", 0) >= 800,
                 timeout_s=300, what="800 updates")
        output = _interrupt(first, signal.SIGINT)
    finally:
        first.stop()
    assert "continue it with gemq run --resume u --redis-url URL" in output
    assert store.state() == RunState.RUNNING and store.leader() is None
    version = store.head().version
    resumed = _gemq("run", "--resume", "u", "--redis-url", redis_server.url, "--out",
                    str(out), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert store.state() == RunState.FINISHED and store.head().version == 3000
    _assert_one_curve(_curve(out / "metrics.csv"), version, 3000)


def test_resuming_what_cannot_be_resumed_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for args, says in ((("--resume", "nowhere"), "no such run folder"),
                       (("--resume", "empty"), "holds no saved state"),
                       (("--resume", "empty", "--local-cluster", "3"), "cannot be resumed")):
        done = _gemq("run", *args, "--no-progress", cwd=tmp_path)
        assert done.returncode in (1, 2), done.stderr
        assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_resumed_curves_drop_the_rows_the_saved_state_does_not_hold(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    """A crash saves the state a little before the curves' last flush: the rows written
    after the state are not the resumed run's history, and go."""
    store = small_run(redis_client, "c")
    ids = [redis_client.xadd(store.keys.metrics, {"t_ms": i, "updates": i}).decode()
           for i in (1, 2, 3)]
    path = tmp_path / "metrics.csv"
    header = CurveReader(store).rows.columns
    later = f"{int(ids[-1].split('-')[0]) + 5000}-0"  # written after the state was saved
    with path.open("w", newline="") as f:
        CsvSink(f, header).write([{"stream_id": i, "t_ms": u, "updates": u}
                                  for i, u in ((ids[0], 1), (ids[1], 2), (ids[2], 3),
                                               (later, 4))])
    new = redis_client.xadd(store.keys.metrics, {"t_ms": 9, "updates": 9}).decode()
    with CurveRecorder(store, RunFolder(tmp_path, "c", ()), append=True) as curves:
        curves.poll()
    rows = _curve(path)
    assert [row["stream_id"] for row in rows] == [*ids, new]
    assert [row["updates"] for row in rows] == ["1", "2", "3", "9"]
