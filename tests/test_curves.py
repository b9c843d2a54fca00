"""A run's curves (gemq/records/: curves.py, export.py, recording.py): the row format, and
the same rows from a local run's metrics.csv, `gemq export` and the metrics stream."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gemq import cli
from gemq.records import curves
from gemq.records.curves import (
    BASE_COLUMNS,
    HELD_OUT,
    CurveReader,
    CurveRows,
    UpdateRate,
    columns,
)
from gemq.records.export import export_curves
from gemq.running.embedded import EmbeddedRedis
from gemq.state.store import RunStore
from tests.helpers import SMALL_LAYOUT, GemqProcess, aggregated_run, session, wait_for

TENSORS = [t.name for t in SMALL_LAYOUT.params]


def gemq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gemq", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def stream(store: RunStore) -> list[tuple[str, dict[str, str]]]:
    return store.metrics_since("0-0", count=10**6)


def read_csv(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


# --- the row format --------------------------------------------------------------------


def test_the_header_names_the_base_columns_then_a_pi_column_per_tensor() -> None:
    assert columns(["conv.weight", "fc.bias"]) == [
        "stream_id", "t_ms", "updates", "applied", "rejected", "loss", "accuracy",
        "energy_ratio", "median_pi", "staleness_mean", "staleness_max", "active_workers",
        "e_central", "e_proxy", "updates_per_s", "eval_updates", "test_loss", "test_accuracy",
        "pi:conv.weight", "pi:fc.bias"]


def test_a_row_is_typed_and_has_no_nan() -> None:
    rows = CurveRows(["a", "b", "c"])
    fields = {"t_ms": "1000", "updates": "5", "applied": "5", "rejected": "1",
              "loss": "0.25", "accuracy": "0.75", "energy_ratio": "nan", "median_pi": "1.5",
              "staleness_mean": "2.5", "staleness_max": "4", "active_workers": "3",
              "e_central": "0.5", "e_proxy": "0", "pi_tensors": "[0.5, null, 2]",
              "eval_updates": "4", "test_loss": "0.5", "test_accuracy": "0.875"}
    row = rows.row("1000-0", fields)
    assert row == {"stream_id": "1000-0", "t_ms": 1000, "updates": 5, "applied": 5,
                   "rejected": 1, "loss": 0.25, "accuracy": 0.75, "energy_ratio": None,
                   "median_pi": 1.5,
                   "staleness_mean": 2.5, "staleness_max": 4, "active_workers": 3,
                   "e_central": 0.5, "e_proxy": 0.0, "updates_per_s": None,
                   "eval_updates": 4, "test_loss": 0.5, "test_accuracy": 0.875, "pi:a": 0.5,
                   "pi:b": None, "pi:c": 2.0}
    assert list(row) == rows.columns
    later = rows.row("1001-0", {"t_ms": "1500", "updates": "9"})  # fields missing: None
    assert later["loss"] is None and later["pi:a"] is None
    assert later["updates_per_s"] == 8.0  # 4 updates in 0.5 s


def test_the_rate_is_the_dashboards() -> None:
    """web/js/series.js rateSeries: over the last 2 s of wall time, nothing under 250 ms."""
    rate = UpdateRate()
    points = [(0, 0), (100, 10), (300, 20), (1000, 50), (2200, 100), (2500, 130),
              (4400, 200)]
    got = [rate.add(t, u) for t, u in points]
    # At (2200, 100) the window starts at (100, 10), the newest row 2 s old or more; at
    # (2500, 130) at (300, 20); at (4400, 200) at (2200, 100).
    assert got == [None, None, 66.67, 50.0, 42.86, 50.0, 45.45]


# --- read back from a real Redis ---------------------------------------------------------


def test_export_holds_every_stream_entry_in_order(redis_client: redis.Redis,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store = aggregated_run(redis_client, "exp", updates=12)
    monkeypatch.setattr(curves, "PAGE", 5)  # the reader resumes across pages
    out = io.StringIO()
    assert export_curves(store, out, "csv") == 12
    rows, entries = read_csv(out.getvalue()), stream(store)
    assert list(rows[0]) == columns(TENSORS)
    assert [r["stream_id"] for r in rows] == [i for i, _ in entries]
    for row, (_, fields) in zip(rows, entries, strict=True):
        for name in ("t_ms", "updates", "applied", "staleness_max", "active_workers"):
            assert row[name] == fields[name]
        for name in ("loss", "energy_ratio", "median_pi", "staleness_mean"):
            assert math.isclose(float(row[name]), float(fields[name]))
    assert [int(r["updates"]) for r in rows] == list(range(1, 13))
    assert max(int(r["staleness_max"]) for r in rows) == 2
    sampled = [r for r in rows if r["pi:w"]]  # the aggregator samples pi about once a second
    assert sampled and all(float(r["pi:b"]) >= 0 for r in sampled)


def test_a_reader_picks_up_where_it_stopped(redis_client: redis.Redis) -> None:
    store = aggregated_run(redis_client, "resume", updates=6)
    reader = CurveReader(store)
    first = [row for page in reader.pages() for row in page]
    assert len(first) == 6 and list(reader.pages()) == []


def test_gemq_export_writes_csv_or_json_lines(redis_server: EmbeddedRedis,
                                              redis_client: redis.Redis,
                                              tmp_path: Path) -> None:
    store = aggregated_run(redis_client, "cli-exp", updates=8)
    expected = io.StringIO()
    export_curves(store, expected, "csv")
    to_file = gemq("export", "--run", "cli-exp", "--redis-url", redis_server.url,
                   "--out", str(tmp_path / "c.csv"))
    assert to_file.returncode == 0, to_file.stderr
    assert to_file.stderr == f"run cli-exp: 8 rows written to {tmp_path / 'c.csv'}\n"
    assert (tmp_path / "c.csv").read_text() == expected.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.csv"]
    jsonl = gemq("export", "--run", "cli-exp", "--redis-url", redis_server.url,
                 "--format", "jsonl")
    assert (jsonl.returncode, jsonl.stderr) == (0, "")
    lines = [json.loads(line) for line in jsonl.stdout.splitlines()]
    assert [list(line) for line in lines] == [columns(TENSORS)] * 8
    assert [line["stream_id"] for line in lines] == [i for i, _ in stream(store)]
    assert lines[0]["updates_per_s"] is None  # JSON has no NaN: null


def test_exporting_an_unknown_run_is_one_error_and_no_file(redis_server: EmbeddedRedis,
                                                          tmp_path: Path) -> None:
    result = gemq("export", "--run", "nosuch", "--redis-url", redis_server.url,
                  "--out", str(tmp_path / "c.csv"))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == "gemq: error: no run 'nosuch' in Redis\n"
    assert list(tmp_path.iterdir()) == []


def test_export_help_shows_defaults_and_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: csv)" in text and "default: standard output" in text
    assert "example: gemq export --run $RUN --redis-url" in text


def test_a_row_for_every_base_column() -> None:
    """The columns are exactly the metrics stream's fields (pi_tensors spread over the
    tensors, and the held-out evaluation a commit carries), plus the id and the dashboard's
    rate: nothing the dashboard plots is lost."""
    from gemq.aggregation.window import CommitWindow

    fields = CommitWindow().metrics(0, 0, [1.0])
    assert (set(fields) - {"pi_tensors"} | {"stream_id", "updates_per_s"} | set(HELD_OUT)
            == set(BASE_COLUMNS))


def test_tensorboard_without_its_extra_is_one_error_before_the_run(tmp_path: Path) -> None:
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "tensorboard.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'tensorboard'\", name='tensorboard')\n")
    result = subprocess.run(
        [sys.executable, "-m", "gemq", "run", "--model", "mlp", "--dataset", "digits",
         "--steps", "5", "--tensorboard", "tb", "--no-progress"], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(hidden)}, capture_output=True, text=True,
        timeout=120, check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("gemq: error: tensorboard: needs the tensorboard package: "
                             "pip install 'gemq[tensorboard]'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hide"]  # no run, no runs/


# --- a real `gemq run` -------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Path, redis.Redis, EmbeddedRedis]]:
    """`gemq run` of 100 updates on a Redis the test can read afterwards (TensorBoard
    scalars too, where the tensorboard extra is installed)."""
    out = tmp_path_factory.mktemp("curves-run")
    tensorboard = has_tensorboard()
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        result = gemq("run", "--model", "mlp", "--dataset", "digits", "--steps", "100",
                      "--workers", "2", "--run", "crv", "--redis-url", server.url,
                      "--out", str(out / "run"), "--json", str(out / "s.json"),
                      "--no-progress",
                      *(["--tensorboard", str(out / "tb")] if tensorboard else []),
                      timeout=180)
        assert result.returncode == 0, result.stderr
        assert f"curves:  {out / 'run' / 'metrics.csv'}" in result.stdout
        yield out, client, server
        client.close()


def has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_gemq_run_leaves_a_row_per_commit_of_its_updates(
        finished_run: tuple[Path, redis.Redis, EmbeddedRedis]) -> None:
    out, client, server = finished_run
    text = (out / "run" / "metrics.csv").read_text()
    rows = read_csv(text)
    summary = json.loads((out / "s.json").read_text())
    assert len(rows) == summary["metrics_rows"]
    assert sum(int(r["applied"]) for r in rows) == summary["updates_applied"] == 100
    updates = 0
    for row in rows:  # each row's count is the one before plus what its commit applied
        updates += int(row["applied"])
        assert int(row["updates"]) == updates
    assert [r["stream_id"] for r in rows] == [i for i, _ in stream(RunStore(client, "crv"))]
    assert [c.removeprefix("pi:") for c in list(rows[0])[len(BASE_COLUMNS):]] == [
        "net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"]
    exported = gemq("export", "--run", "crv", "--redis-url", server.url)
    assert exported.stdout == text  # the same format, from the same stream


@pytest.mark.slow
def test_gemq_run_writes_the_same_scalars_to_tensorboard(
        finished_run: tuple[Path, redis.Redis, EmbeddedRedis]) -> None:
    if not has_tensorboard():
        pytest.skip("the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = finished_run
    rows = read_csv((out / "run" / "metrics.csv").read_text())
    (log_dir,) = (out / "tb").iterdir()
    assert log_dir.name == "crv"
    events = EventAccumulator(str(log_dir))
    events.Reload()
    # A column with no value (the rate, when the run's rows all fall within 250 ms) has no
    # scalars; every other one has its tag.
    tags = {"applied", "rejected", "loss", "accuracy", "energy_ratio", "median_pi",
            "staleness_mean", "staleness_max", "active_workers", "e_central", "e_proxy",
            "updates_per_s", *HELD_OUT, "pi/net.1.weight", "pi/net.1.bias", "pi/net.3.weight",
            "pi/net.3.bias"}
    empty = {c.replace("pi:", "pi/") for c in rows[0] if not any(r[c] for r in rows)}
    assert empty <= {"updates_per_s", *HELD_OUT}  # a run shorter than eval_every has none
    assert set(events.Tags()["scalars"]) == tags - empty
    for tag, column in (("loss", "loss"), ("updates_per_s", "updates_per_s"),
                        ("pi/net.1.bias", "pi:net.1.bias")):
        if tag in empty:
            continue
        kept = [r for r in rows if r[column]]
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [int(r["updates"]) for r in kept]
        assert [s.value for s in scalars] == pytest.approx([float(r[column]) for r in kept],
                                                           rel=1e-6)
        assert [s.wall_time for s in scalars] == pytest.approx(
            [int(r["t_ms"]) / 1000 for r in kept])


@pytest.mark.slow
def test_the_summary_is_typed_and_its_json_unchanged(
        finished_run: tuple[Path, redis.Redis, EmbeddedRedis]) -> None:
    from gemq.config import RunConfig
    from gemq.records.summary import RunSummary

    out, _, _ = finished_run
    stored = json.loads((out / "run" / "summary.json").read_text())
    assert set(stored) == {
        "run_id", "state", "updates_applied", "published", "rejected", "unused", "version",
        "staleness_mean", "staleness_max", "energy_ratio", "median_pi",
        "aggregation_time_s", "metrics_rows", "redis", "wall_time_s", "train_loss",
        "train_accuracy", "test_loss", "test_accuracy", "parameters", "test_samples",
        "workers", "config", "updates_per_s", "model_path", "summary_path", "shards",
        "workers_joined", "problems", "chosen_by_gemq", "redis_bound_mb", "redis_peak_mb",
        "baseline_loss"}
    summary = RunSummary.from_dict(stored)
    assert isinstance(summary.config, RunConfig) and summary.config.budget_updates == 100
    assert summary.model_path == out / "run" / "model.pt"
    assert summary.metrics_path == out / "run" / "metrics.csv"
    assert summary.to_dict() == stored
    with pytest.raises(AttributeError):
        summary.state = "stopped"  # type: ignore[misc]


@pytest.mark.slow
def test_a_killed_run_leaves_its_curves_so_far(redis_server: EmbeddedRedis,
                                               redis_client: redis.Redis,
                                               tmp_path: Path) -> None:
    """The file is flushed as rows come: once the aggregator and workers are frozen, it
    catches up with the stream, and SIGKILL then leaves every row."""
    path = tmp_path / "run" / "metrics.csv"
    store = RunStore(redis_client, "killed")
    process = GemqProcess("run", "--model", "mlp", "--dataset", "digits", "--steps", "100000",
                          "--workers", "2", "--run", "killed", "--redis-url",
                          redis_server.url, "--out", str(tmp_path / "run"))
    try:
        wait_for(lambda: store.exists() and len(stream(store)) >= 20, timeout_s=120,
                 what=f"20 metrics rows: {process.output()}")
        main = process.process.pid
        for line in session(main):  # freeze the children: no more commits
            if int(line.split()[0]) != main:
                os.kill(int(line.split()[0]), signal.SIGSTOP)
        entries = settled(store)
        wait_for(lambda: len(read_csv(path.read_text())) == len(entries), timeout_s=10,
                 what="metrics.csv to hold every row of the stream")
    finally:
        process.stop()  # SIGKILL, to the whole process tree
    rows = read_csv(path.read_text())
    assert [r["stream_id"] for r in rows] == [i for i, _ in entries]
    assert all(None not in r and None not in r.values() for r in rows)  # no cut-off row


def settled(store: RunStore) -> list[tuple[str, dict[str, str]]]:
    """The stream's entries once it has stopped growing (a commit sent just before the
    aggregator froze still lands)."""
    before = stream(store)
    while True:
        time.sleep(0.5)
        after = stream(store)
        if after == before:
            return after
        before = after
