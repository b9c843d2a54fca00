"""gemq sizes a new run from its model, its workers and its Redis (gemq.running.sizing): the
rules on their own, then as users meet them, against real redis-server processes with a
maxmemory (the CLI in this process, ``gemq run`` as a subprocess, the API as a service)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from benchmarks.big_models import MLP_1M, MLP_11M, MLP_150M, mlp_shapes
from gemq.aggregation.snapshots import kept_versions
from gemq.config import AUTO_SETTINGS, RunConfig
from gemq.layout import ParamLayout
from gemq.running.embedded import EmbeddedRedis
from gemq.running.sizing import MB, Room, RunTooBig, redis_bytes, size_run
from gemq.shards import ShardPlan
from tests.test_api import TOKEN, start_api
from tests.test_cli import assert_one_error, in_process

ROOT = Path(__file__).resolve().parents[1]
PAPER_CNN = ParamLayout.from_shapes([("w", (163_790,))])  # the paper CNN's element count
MLP_1M_LAYOUT = ParamLayout.from_shapes(mlp_shapes(*MLP_1M))
MLP_11M_LAYOUT = ParamLayout.from_shapes(mlp_shapes(*MLP_11M))
MLP_150M_LAYOUT = ParamLayout.from_shapes(mlp_shapes(*MLP_150M))
UNBOUNDED = Room(None, "no maxmemory")
SIZED = ("shards", "max_pending", "snapshot_budget_mb", "wire_dtype", "publish_every")
DEFAULTS = RunConfig(run_id="r")


def sized(layout: ParamLayout, workers: int, room: Room = UNBOUNDED,
          **given: object) -> RunConfig:
    config = RunConfig(run_id="r").replace(**given)
    return size_run(config, [n for n in AUTO_SETTINGS if n not in given], layout, workers,
                    room).config


def values(config: RunConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in SIZED}


@pytest.mark.parametrize("workers", [1, 2, 4, 8, 16])
def test_a_small_model_keeps_the_values_it_always_had(workers: int) -> None:
    sizing = size_run(DEFAULTS, AUTO_SETTINGS, PAPER_CNN, workers, UNBOUNDED)
    assert values(sizing.config) == values(DEFAULTS)
    assert not sizing.differs_from_defaults()  # and gemq run says nothing about it


def test_the_11m_mlp_gets_the_settings_measured_for_it() -> None:
    """What docs/performance.md measured by hand for this model and 2 workers: few in
    flight, snapshots for every gradient in flight, half the bytes each way."""
    config = sized(MLP_11M_LAYOUT, 2)
    assert values(config) == {"shards": 1, "max_pending": 4, "snapshot_budget_mb": 305,
                              "wire_dtype": "bfloat16", "publish_every": 2}
    assert kept_versions(config, MLP_11M_LAYOUT.size) == 4 + 2 + 1


def test_the_150m_mlp_gets_the_fewest_shards_that_hold_it() -> None:
    config = sized(MLP_150M_LAYOUT, 1)
    assert config.shards == 10  # 586 MB in shards of at most 64 MB
    ShardPlan.of(MLP_150M_LAYOUT, config.shards)  # and they do hold it


def test_many_workers_get_snapshots_for_every_gradient_in_flight() -> None:
    config = sized(PAPER_CNN, 100)
    assert config.max_pending == 4
    assert kept_versions(config, PAPER_CNN.size) >= 4 + 100 + 1


def test_given_values_win_and_the_rest_is_chosen_around_them() -> None:
    config = sized(MLP_11M_LAYOUT, 2, shards=2, wire_dtype="float32")
    assert (config.shards, config.wire_dtype) == (2, "float32")
    assert config.max_pending == 4 and config.publish_every == 2
    shard = max(s.size for s in ShardPlan.of(MLP_11M_LAYOUT, 2).shards)
    assert kept_versions(config, shard) == 4 + 2 + 1


def test_a_private_cluster_gets_a_shard_per_master() -> None:
    sizing = size_run(DEFAULTS, AUTO_SETTINGS, PAPER_CNN, 2, Room(None, "", min_shards=3))
    assert sizing.config.shards == 3
    assert "shards 3: one per master of the private cluster" in sizing.describe()
    assert sized(PAPER_CNN, 2, Room(None, "", masters=3)).shards == 1  # a cluster you bring


def test_on_a_cluster_each_master_holds_its_share_of_the_shards() -> None:
    """Three masters of 1 GB: the 11.4 M MLP in 3 shards needs a third on each."""
    config = sized(MLP_11M_LAYOUT, 2, shards=3)
    needed = redis_bytes(config, ShardPlan.of(MLP_11M_LAYOUT, 3), 2)
    assert Room(needed // 3 + 1, "", masters=3).fits(config, needed)
    assert not Room(needed // 3 - 1, "", masters=3).fits(config, needed)
    assert not Room(needed // 3 + 1, "").fits(config, needed)  # one Redis holds all three


def test_a_redis_with_a_small_value_limit_gets_more_shards() -> None:
    """A Redis whose proto-max-bulk-len is 16 MB: the 43 MB model in shards under it."""
    config = sized(MLP_11M_LAYOUT, 2, Room(None, "", value_limit=16 * MB))
    assert config.shards == 3
    assert all(4 * s.size < 16 * MB for s in ShardPlan.of(MLP_11M_LAYOUT, 3).shards)


def test_a_tight_redis_gets_fewer_gradients_in_flight_within_its_room() -> None:
    room = Room(256 * MB, "maxmemory 256 MB")
    roomy = size_run(DEFAULTS, AUTO_SETTINGS, MLP_1M_LAYOUT, 2, UNBOUNDED)
    tight = size_run(DEFAULTS, AUTO_SETTINGS, MLP_1M_LAYOUT, 2, room)
    assert roomy.redis_bytes > room.free_bytes  # type: ignore[operator]
    assert tight.redis_bytes <= room.free_bytes  # type: ignore[operator]
    assert 1 <= tight.config.max_pending < roomy.config.max_pending
    assert kept_versions(tight.config, MLP_1M_LAYOUT.size) >= tight.config.max_pending + 3
    assert "fewer in flight to fit the Redis" in tight.describe()


def test_a_run_that_cannot_fit_is_refused_with_what_it_needs() -> None:
    with pytest.raises(RunTooBig, match=r"^this run needs up to \d+ MB of Redis memory .* "
                                        r"and the Redis has 256 MB free \(maxmemory\): "
                                        r"raise its maxmemory by \d+ MB or more"):
        size_run(DEFAULTS, AUTO_SETTINGS, MLP_11M_LAYOUT, 2, Room(256 * MB, "maxmemory"))
    with pytest.raises(RunTooBig):  # given values are checked, never changed
        sized(MLP_1M_LAYOUT, 2, Room(256 * MB, "maxmemory"), max_pending=64)


def test_a_private_redis_over_the_machines_share_gets_a_warning_not_a_refusal(
        caplog: pytest.LogCaptureFixture) -> None:
    """This machine's memory is a guide, not a wall: given values are warned about."""
    room = Room(256 * MB, "a third of this machine's memory", strict=False)
    config = sized(MLP_1M_LAYOUT, 2, room, max_pending=64)
    assert config.max_pending == 64
    assert "may make its Redis hold up to" in caplog.text and "fewer workers" in caplog.text


def test_the_bound_counts_every_value_a_run_can_make_its_redis_hold() -> None:
    """One shard of the 11.4 M MLP, 2 workers, max_pending 4, 7 snapshots: 7 snapshots,
    3 moments (one per worker, one staged), a staged vector, 3 reads; 6 bfloat16 gradients
    in the stream, 6 more in read replies, 2 on their way in; each rounded up a quarter;
    32 MB base."""
    config = sized(MLP_11M_LAYOUT, 2)
    state = 4 * MLP_11M_LAYOUT.size
    gradient = 2 * MLP_11M_LAYOUT.size + 64 * 1024
    expected = 1.25 * ((7 + 3 + 1 + 3) * state + (2 * 6 + 2) * gradient) + 32 * MB
    assert redis_bytes(config, ShardPlan.of(MLP_11M_LAYOUT, 1), 2) == pytest.approx(expected,
                                                                                   abs=1)


@pytest.fixture
def redis_of_256mb(redis_server: EmbeddedRedis, redis_client: redis.Redis) -> EmbeddedRedis:
    redis_client.config_set("maxmemory", "256mb")
    return redis_server


CREATE = ("create", "--dataset", "mnist5k", "--steps", "10", "--run", "r")


def test_gemq_create_refuses_a_run_its_redis_cannot_hold_before_writing_anything(
        redis_of_256mb: EmbeddedRedis, redis_client: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(capsys, *CREATE, "--model", "benchmarks.big_models:mlp_11m",
                        "--redis-url", redis_of_256mb.url)
    line = assert_one_error(result, 1)
    assert "this run needs up to" in line and "raise its maxmemory" in line
    assert redis_client.dbsize() == 0


def test_gemq_create_says_what_it_chose_and_stores_it(
        redis_of_256mb: EmbeddedRedis, redis_client: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(capsys, *CREATE, "--model", "benchmarks.big_models:mlp_1m",
                        "--workers", "2", "--redis-url", redis_of_256mb.url)
    assert result.returncode == 0 and result.stdout.strip() == "r", result.stderr
    assert result.stderr.startswith("run r: sized for a 3.6 MB model and 2 workers")
    assert "Redis memory: at most" in result.stderr
    stored = RunConfig.from_json(redis_client.get("gemq:{r}:config") or b"")
    assert values(stored) == values(sized(MLP_1M_LAYOUT, 2, Room(
        256 * MB - int(redis_client.info("memory")["used_memory"]), "")))


def test_flags_and_variables_take_auto_or_a_value(
        redis_server: EmbeddedRedis, redis_client: redis.Redis, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMQ_MAX_PENDING", "auto")
    settings = tmp_path / "settings.toml"
    settings.write_text('snapshot-budget-mb = "auto"\n')
    result = in_process(capsys, *CREATE, "--model", "logreg", "--shards", "auto",
                        "--wire-dtype", "auto", "--publish-every", "1",
                        "--config", str(settings), "--redis-url", redis_server.url)
    assert result.returncode == 0, result.stderr
    stored = RunConfig.from_json(redis_client.get("gemq:{r}:config") or b"")
    assert values(stored) == values(DEFAULTS)
    result = in_process(capsys, *CREATE, "--model", "logreg", "--shards", "several",
                        "--redis-url", redis_server.url)
    assert "--shards: invalid int value: 'several'" in assert_one_error(result, 2)


def test_gemq_run_on_a_tight_redis_is_sized_to_fit_and_finishes(
        redis_of_256mb: EmbeddedRedis, redis_client: redis.Redis, tmp_path: Path) -> None:
    """The 3.6 MB MLP with the values small models keep would not fit 256 MB (refused at
    once); with no flag it is sized to fit, trains to its end, and Redis stays within the
    bound it printed."""
    command = [sys.executable, "-m", "gemq", "run", "--model", "benchmarks.big_models:mlp_1m",
               "--dataset", "mnist5k", "--workers", "2", "--steps", "150",
               "--redis-url", redis_of_256mb.url, "--no-progress"]
    refused = subprocess.run([*command, "--max-pending", "64", "--snapshot-budget-mb", "64",
                              "--out", str(tmp_path / "refused")],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "this run needs up to" in refused.stderr
    assert redis_client.dbsize() == 0

    done = subprocess.run([*command, "--out", str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = re.search(r"Redis memory: at most (\d+) MB of (\d+) MB free", done.stderr)
    assert printed, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["updates_applied"] == 150
    assert summary["rejected"] == {}
    assert set(summary["chosen_by_gemq"]) == set(SIZED)
    assert summary["config"]["max_pending"] < sized(MLP_1M_LAYOUT, 2).max_pending
    assert summary["redis_bound_mb"] <= int(printed.group(2))
    assert summary["redis_peak_mb"] <= int(printed.group(1)) + 1  # the printed MB are rounded
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert f"max-pending = {summary['config']['max_pending']}\n" in saved
    (comment,) = [line for line in saved.splitlines() if "chosen by gemq" in line]
    assert {name.replace("_", "-") for name in SIZED} <= set(re.findall(r"[a-z-]+", comment))


def test_the_api_sizes_a_run_and_refuses_one_its_redis_cannot_hold(
        redis_of_256mb: EmbeddedRedis, redis_client: redis.Redis) -> None:
    api = start_api(redis_of_256mb.url, GEMQ_API_TOKEN=TOKEN, GEMQ_ALLOW_IMPORT_SPECS="true")
    try:
        with api.client(TOKEN) as c:
            too_big = c.post("/api/runs", json={"model": "benchmarks.big_models:mlp_11m",
                                                "steps": 10, "run_id": "big", "start": False})
            fits = c.post("/api/runs", json={"model": "benchmarks.big_models:mlp_1m",
                                             "steps": 10, "run_id": "fits", "start": False,
                                             "workers": 2, "wire_dtype": "auto",
                                             "shards": 1})
            bad = c.post("/api/runs", json={"model": "logreg", "max_pending": "many"})
    finally:
        api.process.stop()
    assert too_big.status_code == 507, too_big.text
    assert "raise its maxmemory" in too_big.json()["detail"]
    assert not redis_client.exists("gemq:{big}:config")
    assert fits.status_code == 201, fits.text
    assert fits.json()["config"]["max_pending"] < sized(MLP_1M_LAYOUT, 2).max_pending
    assert bad.status_code == 422
