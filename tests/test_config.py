"""RunConfig validation and the Redis key layout (gemq/config.py, gemq/state/keys.py)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math

import pytest
from redis.crc import key_slot

from gemq.config import RunConfig
from gemq.errors import ConfigError, GemqError
from gemq.ids import is_valid_run_id, is_valid_worker_id
from gemq.state.keys import RUNS_INDEX, RunKeys, shard_tag

DEFAULTS = {
    "run_id": "r1", "algo": "gem", "lr": 0.05, "momentum": 0.9, "kappa": 1.0,
    "pi_max": 5.0, "eps": 1e-12, "proxy": "local", "batch_size": 64,
    "budget_updates": 1000, "model": "cnn", "dataset": "mnist5k", "seed": 0,
    "max_staleness": 512, "snapshot_budget_mb": 64, "history": 0, "max_pending": 64,
    "read_batch": 32,
    "worker_timeout_s": 60.0, "max_message_bytes": 0, "wire_dtype": "float32",
    "publish_every": 1, "publish_interval_ms": 0, "max_rejected_in_a_row": 1000,
    "stall_timeout_s": 120.0, "loss": "cross_entropy", "amp": "off",
    "checkpoint_overhead": 0.05, "shards": 1, "eval_every": 200,
    "optimizer": "momentum", "beta2": 0.999, "adam_eps": 1e-8,
}


# --- RunConfig ------------------------------------------------------------------------


def test_defaults() -> None:
    assert dataclasses.asdict(RunConfig("r1")) == DEFAULTS


def test_config_is_frozen() -> None:
    config = RunConfig("r1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]


def test_json_round_trip_keeps_every_field() -> None:
    config = RunConfig("exp.7-b", algo="downpour", lr=0.125, momentum=0.5, kappa=2.0,
                       pi_max=3.0, batch_size=16, budget_updates=77, model="mlp",
                       dataset="digits", seed=42, max_staleness=0, history=8,
                       max_pending=3, read_batch=5, worker_timeout_s=1.5,
                       max_message_bytes=4096, wire_dtype="float16", publish_every=1,
                       publish_interval_ms=25)
    text = config.to_json()
    assert json.loads(text)["lr"] == 0.125
    assert list(json.loads(text)) == sorted(DEFAULTS)
    again = RunConfig.from_json(text)
    assert again == config
    assert RunConfig.from_json(text.encode()) == config


def test_from_dict_coerces_exact_numbers() -> None:
    config = RunConfig.from_dict({"run_id": "r1", "lr": 1, "batch_size": 32.0})
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.batch_size == 32 and isinstance(config.batch_size, int)


def test_replace_validates() -> None:
    config = RunConfig("r1")
    assert config.replace(lr=0.5).lr == 0.5
    assert config.lr == 0.05
    with pytest.raises(ConfigError) as info:
        config.replace(lr=0.0)
    assert info.value.field == "lr"


@pytest.mark.parametrize(("changes", "field"), [
    ({"lr": 0.0}, "lr"),
    ({"lr": -0.1}, "lr"),
    ({"lr": math.nan}, "lr"),
    ({"lr": math.inf}, "lr"),
    ({"lr": 10.5}, "lr"),
    ({"momentum": 1.0}, "momentum"),
    ({"momentum": -0.01}, "momentum"),
    ({"kappa": 0.0}, "kappa"),
    ({"pi_max": 0.0}, "pi_max"),
    ({"eps": 0.0}, "eps"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 65537}, "batch_size"),
    ({"budget_updates": 0}, "budget_updates"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"history": -1}, "history"),
    ({"max_pending": 0}, "max_pending"),
    ({"read_batch": 0}, "read_batch"),
    ({"worker_timeout_s": 0.0}, "worker_timeout_s"),
    ({"max_message_bytes": -1}, "max_message_bytes"),
    ({"algo": "nope"}, "algo"),
    ({"proxy": "remote"}, "proxy"),
    ({"wire_dtype": "int8"}, "wire_dtype"),
    ({"publish_every": 0}, "publish_every"),
    ({"publish_every": 33}, "publish_every"),  # > max_pending / 2: workers would stall
    ({"publish_every": 3, "max_pending": 5}, "publish_every"),
    ({"publish_interval_ms": -1}, "publish_interval_ms"),
    ({"publish_interval_ms": 60_001}, "publish_interval_ms"),
    ({"model": "  "}, "model"),
    ({"dataset": ""}, "dataset"),
    ({"run_id": "bad id"}, "run_id"),
    ({"run_id": ""}, "run_id"),
    ({"run_id": "-leading-dash"}, "run_id"),
])
def test_range_checks_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig(**{"run_id": "r1", **changes})  # type: ignore[arg-type]
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, GemqError) and isinstance(info.value, ValueError)


def test_range_messages() -> None:
    with pytest.raises(ConfigError, match=r"^lr: must be in \(0, 10\], got -1$"):
        RunConfig("r1", lr=-1.0)
    with pytest.raises(ConfigError, match=r"^lr: must be finite, got nan$"):
        RunConfig("r1", lr=math.nan)
    with pytest.raises(ConfigError, match=r"^momentum: must be in \[0, 1\), got 1$"):
        RunConfig("r1", momentum=1.0)
    with pytest.raises(ConfigError, match=r"^algo: must be one of gem, downpour, adaptive, "
                                          r"dcasgd; got 'nope'$"):
        RunConfig("r1", algo="nope")


@pytest.mark.parametrize(("changes", "accepted"), [
    ({"momentum": 0.0}, 0.0),
    ({"lr": 10.0}, 10.0),
    ({"seed": 2**32 - 1}, 2**32 - 1),
    ({"max_staleness": 0}, 0),
    ({"batch_size": 1}, 1),
    ({"publish_every": 32}, 32),
    ({"publish_every": 1, "max_pending": 1}, 1),
    ({"publish_interval_ms": 60_000}, 60_000),
    ({"wire_dtype": "bfloat16"}, "bfloat16"),
])
def test_bounds_are_inclusive_where_documented(changes: dict[str, object],
                                               accepted: object) -> None:
    config = RunConfig(**{"run_id": "r1", **changes})  # type: ignore[arg-type]
    assert getattr(config, next(iter(changes))) == accepted


@pytest.mark.parametrize(("data", "field", "message"), [
    ({"run_id": "r1", "learning_rate": 0.1}, "learning_rate", "unknown setting"),
    ({"run_id": "r1", "zzz": 1, "aaa": 2}, "aaa", "unknown setting"),
    ({"run_id": "r1", "lr": "0.1"}, "lr", "must be a number, got '0.1'"),
    ({"run_id": "r1", "batch_size": "64"}, "batch_size", "must be a number, got '64'"),
    ({"run_id": "r1", "batch_size": 3.5}, "batch_size", "must be an integer, got 3.5"),
    ({"run_id": "r1", "seed": 0.25}, "seed", "must be an integer, got 0.25"),
    ({"run_id": "r1", "lr": True}, "lr", "must be a number, got True"),
    ({"run_id": "r1", "batch_size": False}, "batch_size", "must be a number, got False"),
    ({"run_id": "r1", "lr": None}, "lr", "cannot read None as float"),
    ({"run_id": "r1", "lr": [0.1]}, "lr", "cannot read [0.1] as float"),
    ({"run_id": "r1", "model": 5}, "model", "must be a string, got 5"),
    ({"run_id": 7}, "run_id", "must be a string, got 7"),
    ({"run_id": "r1", "lr": math.nan}, "lr", "must be finite, got nan"),
])
def test_from_dict_refuses_bad_values(data: dict[str, object], field: str,
                                      message: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict(data)
    assert info.value.field == field
    assert str(info.value) == f"{field}: {message}"


def test_from_json_refuses_nan_learning_rate() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_json('{"run_id": "r1", "lr": NaN}')
    assert info.value.field == "lr"


def test_from_dict_without_run_id_names_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict({"lr": 0.1})
    assert info.value.field == "run_id"


# --- keys -----------------------------------------------------------------------------


def _all_keys(keys: RunKeys) -> dict[str, str]:
    """Every key name RunKeys can produce, found by introspection so new kinds are covered."""
    found: dict[str, str] = {}
    for name, member in inspect.getmembers(RunKeys):
        if name.startswith("_") or name in ("prefix", "tag"):
            continue
        if isinstance(member, property):
            found[name] = getattr(keys, name)
        elif inspect.isfunction(member):
            args = {"params": (7,), "worker": ("w-1",), "staging": ("host:1:ab",),
                    "moment": ("w-1",), "staged_moment": ("host:1:ab", "w-1")}[name]
            found[name] = getattr(keys, name)(*args)
    return found


def test_every_key_of_a_run_carries_the_hash_tag() -> None:
    keys = RunKeys("exp-1")
    assert keys.prefix == "gemq:{exp-1}:"
    assert _all_keys(keys) == {
        "config": "gemq:{exp-1}:config",
        "layout": "gemq:{exp-1}:layout",
        "status": "gemq:{exp-1}:status",
        "shard_tags": "gemq:{exp-1}:shard_tags",
        "head": "gemq:{exp-1}:head",
        "params": "gemq:{exp-1}:params:7",
        "versions": "gemq:{exp-1}:versions",
        "gradients": "gemq:{exp-1}:gradients",
        "metrics": "gemq:{exp-1}:metrics",
        "counters": "gemq:{exp-1}:counters",
        "workers": "gemq:{exp-1}:workers",
        "worker": "gemq:{exp-1}:worker:w-1",
        "lease": "gemq:{exp-1}:lease",
        "staging": "gemq:{exp-1}:staging:host:1:ab",
        "moments": "gemq:{exp-1}:moments",
        "evaluations": "gemq:{exp-1}:evaluations",
        "evaluation_claim": "gemq:{exp-1}:evaluation_claim",
        "moment": "gemq:{exp-1}:moment:w-1",
        "staged_moment": "gemq:{exp-1}:staging:host:1:ab:moment:w-1",
    }


RUN_WIDE = {"config", "layout", "status", "shard_tags"}


def test_each_shard_has_its_own_slot_and_the_run_wide_keys_stay_in_shard_0s() -> None:
    shard0, shard2 = _all_keys(RunKeys("exp-1")), _all_keys(RunKeys("exp-1", 2))
    assert RunKeys("exp-1", 2).prefix == "gemq:{exp-1/2}:"
    for name, key in shard2.items():
        if name in RUN_WIDE:
            assert key == shard0[name]
        else:
            assert key == shard0[name].replace("{exp-1}", "{exp-1/2}")
            assert key_slot(key.encode()) == key_slot(b"exp-1/2")
    slots = {key_slot(RunKeys("exp-1", k).head.encode()) for k in range(16)}
    assert len(slots) == 16  # shards spread over a cluster's slots (and so its masters)


def test_a_placed_shard_takes_its_tag_and_a_foreign_tag_is_refused() -> None:
    default, placed = _all_keys(RunKeys("exp-1", 2)), _all_keys(RunKeys("exp-1", 2, "exp-1/2.7"))
    for name, key in placed.items():
        if name in RUN_WIDE:
            assert key == default[name]
        else:
            assert key == default[name].replace("{exp-1/2}", "{exp-1/2.7}")
    assert shard_tag("exp-1", 2, 7) == "exp-1/2.7" and shard_tag("exp-1", 0, 7) == "exp-1"
    assert RunKeys("exp-1", 2, "exp-1/2").prefix == "gemq:{exp-1/2}:"
    for foreign in ("exp-1/3.7", "exp-2/2.7", "exp-1", "exp-1/2.", "exp-1/2.0", "x}y", "*"):
        with pytest.raises(ValueError, match="no hash tag of shard 2"):
            RunKeys("exp-1", 2, foreign)
    with pytest.raises(ValueError, match="no hash tag of shard 0"):
        RunKeys("exp-1", 0, "exp-1/0.1")


def test_keys_of_a_run_share_one_cluster_slot_and_runs_do_not_collide() -> None:
    a, b = _all_keys(RunKeys("a")), _all_keys(RunKeys("b"))
    assert len(set(a.values())) == len(a)
    assert {key_slot(k.encode()) for k in a.values()} == {key_slot(b"a")}
    assert not set(a.values()) & set(b.values())
    assert RUNS_INDEX == "gemq:runs"
    assert "{" not in RUNS_INDEX


@pytest.mark.parametrize("run_id", ["a", "0", "run-1", "A.b_c-9", "r" * 64])
def test_valid_run_ids(run_id: str) -> None:
    assert is_valid_run_id(run_id)
    assert RunConfig(run_id).run_id == run_id


@pytest.mark.parametrize("run_id", [
    "", " ", "a b", " a", "a ", "a\n", "\n", "a\nb", "a\t", "-a", ".a", "_a", "r" * 65,
    "a{b", "a}b", "a:b", "a/b", "é",
])
def test_invalid_run_ids(run_id: str) -> None:
    assert not is_valid_run_id(run_id)
    with pytest.raises(ConfigError) as info:
        RunConfig(run_id)
    assert info.value.field == "run_id"


@pytest.mark.parametrize("worker_id", ["w", "host-1", "host-123-0", "pod.x_y:3", "w" * 64])
def test_valid_worker_ids(worker_id: str) -> None:
    assert is_valid_worker_id(worker_id)


@pytest.mark.parametrize("worker_id", [
    "", " ", "w 1", "w1 ", "w1\n", "\n", "w\r1", "-w", ":w", "w" * 65, "w{1}", "w}", "ü",
])
def test_invalid_worker_ids(worker_id: str) -> None:
    assert not is_valid_worker_id(worker_id)


# --- settings -> RunConfig: one table, one function --------------------------------------


def test_make_config_budget_in_epochs_steps_or_the_default() -> None:
    from gemq.config import DEFAULT_EPOCHS, make_config

    assert make_config({"steps": 7}, train_samples=1000).budget_updates == 7
    by_epochs = make_config({"epochs": 2, "batch_size": 50}, train_samples=1000)
    assert by_epochs.budget_updates == 40
    default = make_config({"batch_size": 100}, train_samples=1000)
    assert default.budget_updates == math.ceil(DEFAULT_EPOCHS * 1000 / 100)
    with pytest.raises(ConfigError, match="give epochs or steps, not both"):
        make_config({"epochs": 1, "steps": 5}, train_samples=1000)
    with pytest.raises(ConfigError, match=r"^epochs: must be in \(0, 100000\]"):
        make_config({"epochs": 0}, train_samples=1000)


def test_make_config_takes_none_as_the_default_and_names_new_runs() -> None:
    from gemq.config import make_config

    config = make_config({"lr": None, "algo": None, "run_id": None, "steps": 3},
                         train_samples=10)
    assert (config.lr, config.algo) == (RunConfig.lr, RunConfig.algo)  # type: ignore[misc]
    assert config.run_id.startswith("run-")
    assert make_config({"run_id": "mine", "steps": 3}, train_samples=10).run_id == "mine"
    with pytest.raises(ConfigError, match="^nope: unknown setting"):
        make_config({"nope": 1}, train_samples=10)


def test_the_table_describes_every_user_setting_as_runconfig_checks_it() -> None:
    """Each offered setting's default is RunConfig's (or auto, for the settings gemq sizes),
    and its bounds are the ones RunConfig enforces: the lowest and highest allowed values
    pass, one step beyond fails."""
    from gemq.config import AUTO, AUTO_SETTINGS, BUDGET, USER_SETTINGS

    assert set(AUTO_SETTINGS) == {"shards", "max_pending", "snapshot_budget_mb", "wire_dtype",
                                  "publish_every"}
    for setting in (s for s in USER_SETTINGS if s.group != BUDGET):
        expected = AUTO if setting.auto else RunConfig.__dataclass_fields__[setting.name].default
        assert setting.default == expected
        if setting.low is None or setting.high is None:
            continue
        step = 1 if setting.kind is int else 1e-9 * max(1.0, abs(setting.high))
        for value, ok in ((setting.low, not setting.low_open),
                          (setting.high, not setting.high_open),
                          (setting.low - step, False), (setting.high + step, False)):
            changes = {setting.name: setting.kind(value)}
            if setting.name == "publish_every":
                changes["max_pending"] = 10**6  # its own cross-check aside
            if ok:
                RunConfig(run_id="r", **changes)
            else:
                with pytest.raises(ConfigError, match=f"^{setting.name}: "):
                    RunConfig(run_id="r", **changes)


class _Walked(Exception):
    """Raised by the spy once make_config has built the config: the walk ends there."""


@pytest.fixture
def make_config_spy(monkeypatch: pytest.MonkeyPatch) -> list[RunConfig]:
    """Every entry point's make_config replaced by a spy that records the RunConfig the real
    one returns, then stops the caller: a path that bypassed make_config records nothing."""
    import gemq.cli
    import gemq.running.local
    import gemq.services.api.routes.runs as api_runs
    import gemq.sim.command
    from gemq import config as config_module

    built: list[RunConfig] = []

    def spy(settings: dict[str, object], *, train_samples: int) -> RunConfig:
        built.append(config_module.make_config(settings, train_samples=train_samples))
        raise _Walked

    for module in (gemq.cli, gemq.running.local, api_runs, gemq.sim.command):
        monkeypatch.setattr(module, "make_config", spy)
    return built


@pytest.mark.parametrize("command", ["run", "create", "simulate"])
def test_lr_from_the_command_line_reaches_runconfig_through_make_config(
        make_config_spy: list[RunConfig], command: str) -> None:
    from gemq import cli

    argv = [command, "--lr", "0.123", "--model", "logreg", "--dataset", "digits"]
    if command == "create":
        argv += ["--redis-url", "redis://127.0.0.1:1/0"]
    with pytest.raises(_Walked):
        cli.main(argv)
    assert [c.lr for c in make_config_spy] == [0.123]


def test_lr_from_python_reaches_runconfig_through_make_config(
        make_config_spy: list[RunConfig]) -> None:
    import gemq

    with pytest.raises(_Walked):
        gemq.train("logreg", "digits", lr=0.123)
    assert [c.lr for c in make_config_spy] == [0.123]


# Starlette's TestClient prefers the httpx2 package and warns when it runs on httpx.
@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_lr_from_the_api_reaches_runconfig_through_make_config(
        make_config_spy: list[RunConfig]) -> None:
    from fastapi.testclient import TestClient

    from gemq.config import USER_SETTINGS
    from gemq.services.api.app import create_app
    from gemq.services.settings import ApiSettings

    app = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        form = {s["name"]: s for s in client.get("/api/settings").json()["settings"]}
        assert list(form) == [s.name for s in USER_SETTINGS]
        # The optimizer's unless given: "auto" (gemq.config.DEFAULT_LR).
        assert (form["lr"]["default"], form["lr"]["minimum"], form["lr"]["maximum"],
                form["lr"]["exclusive_minimum"], form["lr"]["auto"]) == ("auto", 0, 10, True,
                                                                        True)
        schema = client.get("/openapi.json").json()["components"]["schemas"]["RunRequest"]
        lr = schema["properties"]["lr"]
        number, auto = lr["anyOf"]
        assert (lr["default"], auto["const"]) == ("auto", "auto")
        assert (number["exclusiveMinimum"], number["maximum"]) == (0, 10)
        with pytest.raises(_Walked):
            client.post("/api/runs", json={"lr": 0.123, "model": "logreg",
                                           "dataset": "digits"})
    assert [c.lr for c in make_config_spy] == [0.123]


def test_gemq_train_takes_every_user_setting_by_name() -> None:
    """gemq.train's signature is real (no **kwargs) and offers every setting the CLI and the
    API offer, each defaulting to None (RunConfig's default) but model and dataset."""
    from gemq.config import USER_SETTINGS
    from gemq.running.local import DEFAULT_DATASET, DEFAULT_MODEL, train

    parameters = inspect.signature(train).parameters
    assert not [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    for setting in USER_SETTINGS:
        expected = {"model": DEFAULT_MODEL, "dataset": DEFAULT_DATASET}.get(setting.name)
        assert parameters[setting.name].default == expected, setting.name
