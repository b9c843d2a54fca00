"""The ``gemq`` command line (gemq/cli.py, gemq/cliargs.py), mostly as a real subprocess."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from gemq import cli
from gemq.aggregation.leadership import Leadership
from gemq.cliargs import apply_env_defaults, env_name
from gemq.errors import ConfigError, RedisUnavailable
from gemq.running.embedded import EmbeddedRedis, free_port
from gemq.state.connection import connect, redact
from gemq.state.store import RunStore
from tests.helpers import small_run

# A ConfigError or GemqError caught by main(): "gemq: error: ..."; a flag argparse refuses
# in a subcommand: "gemq <command>: error: ...".
ERROR_LINE = re.compile(r"^gemq(?: [a-z]+)?: error: \S")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMQ_")}
    env.pop("PYTHONWARNINGS", None)
    return {**env, **extra}


def gemq(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gemq", *args], capture_output=True,
                          text=True, env=env if env is not None else _clean_env(),
                          timeout=timeout, check=False, cwd=cwd)


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """main() in this process (torch is already imported here: much faster than a child)."""
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse exits on a bad flag
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["gemq", *args], code, out, err)


def assert_one_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """Exit ``code``, exactly one stderr line, a gemq error line, no traceback."""
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert ERROR_LINE.match(lines[0]), lines[0]
    assert result.returncode == code, (result.returncode, result.stderr)
    return lines[0]


@pytest.fixture(autouse=True)
def _no_gemq_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_parser() reads os.environ: tests start from an environment without GEMQ_*."""
    for name in [n for n in os.environ if n.startswith("GEMQ_")]:
        monkeypatch.delenv(name)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise AssertionError("no subcommands")


# --- bad flags and values: one line, the right exit code ---------------------------------


def test_missing_command() -> None:
    line = assert_one_error(gemq(), cli.EXIT_USAGE)
    assert line == "gemq: error: the following arguments are required: command " \
                   "(see gemq --help)"


def test_unknown_flag() -> None:
    line = assert_one_error(gemq("run", "--nope"), cli.EXIT_USAGE)
    assert line == "gemq: error: unrecognized arguments: --nope (see gemq --help)"


def test_unknown_command() -> None:
    line = assert_one_error(gemq("train"), cli.EXIT_USAGE)
    assert line.startswith("gemq: error: argument command: invalid choice: 'train'")


def test_negative_learning_rate() -> None:
    line = assert_one_error(gemq("run", "--lr", "-1"), cli.EXIT_USAGE)
    assert line == ("gemq run: error: argument --lr: must be in (0, 10], got -1 "
                    "(see gemq run --help)")


def test_zero_batch_size() -> None:
    line = assert_one_error(gemq("run", "--batch-size", "0"), cli.EXIT_USAGE)
    assert line == ("gemq run: error: argument --batch-size: must be in [1, 65536], got 0 "
                    "(see gemq run --help)")


def test_non_numeric_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    line = assert_one_error(in_process(capsys, "create", "--batch-size", "many"),
                            cli.EXIT_USAGE)
    assert line.startswith("gemq create: error: argument --batch-size: invalid")
    assert "'many'" in line


def test_unknown_algorithm() -> None:
    line = assert_one_error(gemq("run", "--algo", "nope"), cli.EXIT_USAGE)
    assert line == ("gemq run: error: argument --algo: invalid choice: 'nope' (choose from "
                    "'gem', 'downpour', 'adaptive', 'dcasgd') (see gemq run --help)")


def test_steps_and_epochs_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    line = assert_one_error(in_process(capsys, "run", "--steps", "5", "--epochs", "1"),
                            cli.EXIT_USAGE)
    assert "not allowed with argument" in line


def test_publication_policy_that_would_stall_workers(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    line = assert_one_error(in_process(capsys, "run", "--publish-every", "40"), cli.EXIT_USAGE)
    assert line == ("gemq: error: publish_every: must be at most max_pending / 2 (32), got 40: "
                    "workers would wait for a publication that cannot come")


@pytest.mark.parametrize("flag", ["--wire-dtype", "--publish-interval-ms", "--max-pending"])
def test_simulate_refuses_transport_flags(capsys: pytest.CaptureFixture[str],
                                          flag: str) -> None:
    # The simulator moves no bytes: a transport setting would be silently ignored there.
    line = assert_one_error(in_process(capsys, "simulate", flag, "5"), cli.EXIT_USAGE)
    assert line == f"gemq: error: unrecognized arguments: {flag} 5 (see gemq --help)"


def test_bad_env_value() -> None:
    result = gemq("run", env=_clean_env(GEMQ_LR="abc"))
    line = assert_one_error(result, cli.EXIT_USAGE)
    assert line == ("gemq: error: GEMQ_LR: invalid value 'abc': could not convert string to "
                    "float: 'abc'")


def test_bad_env_choice(monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GEMQ_ALGO", "nope")
    line = assert_one_error(in_process(capsys, "create"), cli.EXIT_USAGE)
    assert line == ("gemq: error: GEMQ_ALGO: must be one of gem, downpour, adaptive, "
                    "dcasgd, got 'nope'")


def test_unknown_dataset() -> None:
    result = gemq("create", "--dataset", "nope", "--redis-url", "redis://127.0.0.1:1")
    line = assert_one_error(result, 1)
    assert line == ("gemq: error: unknown dataset 'nope': use mnist5k, digits, "
                    "pysource, mnist-idx:DIR or 'package.module:factory'")


def test_unimportable_dataset_factory() -> None:
    result = gemq("create", "--dataset", "gemq_no_such_module:make",
                  "--redis-url", "redis://127.0.0.1:1")
    line = assert_one_error(result, 1)
    assert line == ("gemq: error: dataset 'gemq_no_such_module:make': cannot import "
                    "'gemq_no_such_module': ModuleNotFoundError: No module named "
                    "'gemq_no_such_module' (run gemq from the folder that holds "
                    "gemq_no_such_module, or add that folder to PYTHONPATH)")


def test_dataset_module_that_raises_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gemq_cli_boom.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = in_process(capsys, "create", "--dataset", "gemq_cli_boom:make",
                        "--redis-url", "redis://127.0.0.1:1")
    line = assert_one_error(result, 1)
    assert line == ("gemq: error: dataset 'gemq_cli_boom:make': cannot import "
                    "'gemq_cli_boom': RuntimeError: boom at import")


def test_a_dataset_factory_that_raises_is_one_line_saying_where(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gemq_cli_raises.py").write_text(
        "def make():\n    raise ValueError('no data here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    result = in_process(capsys, "run", "--dataset", "gemq_cli_raises:make", "--steps", "5",
                        "--no-progress")
    line = assert_one_error(result, 1)
    assert line == ("gemq: error: dataset 'gemq_cli_raises:make' raised ValueError: no data "
                    "here (gemq_cli_raises.py, line 2, in make)")
    assert not (tmp_path / "runs").exists()


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize(("device", "message"), [
    ("gpu", "device: unknown device 'gpu': use auto, cpu or cuda[:N]"),
    ("mps", "device: unknown device 'mps': use auto, cpu or cuda[:N]"),
    pytest.param("cuda", "device: cuda: CUDA is not available on this machine (use cpu or "
                 "auto)", marks=NO_CUDA),
    pytest.param("cuda:1", "device: cuda:1: CUDA is not available on this machine (use cpu "
                 "or auto)", marks=NO_CUDA),
])
@pytest.mark.parametrize("command", ["run", "worker"])
def test_a_device_that_cannot_work_is_one_line_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        command: str, device: str, message: str) -> None:
    monkeypatch.chdir(tmp_path)
    args = (["--steps", "5", "--no-progress"] if command == "run"
            else ["--run", "r", "--redis-url", "redis://127.0.0.1:1"])
    result = in_process(capsys, command, "--device", device, *args)
    line = assert_one_error(result, 2)
    assert line == f"gemq: error: {message}"
    assert list(tmp_path.iterdir()) == []  # no run folder, no Redis started


def test_a_negative_process_count_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(capsys, "run", "--worker-processes", "-3", "--steps", "5")
    line = assert_one_error(result, 2)
    assert "--worker-processes: must be 0 or more, got -3" in line


@pytest.mark.parametrize("where", [("--run", "myexp"), ("--out", "runs/myexp")],
                         ids=["--run", "--out"])
def test_a_second_run_of_one_name_refuses_to_overwrite_the_first(
        tmp_path: Path, where: tuple[str, str]) -> None:
    first = tmp_path / "runs" / "myexp"
    first.mkdir(parents=True)
    (first / "summary.json").write_text("{}")
    (first / "model.pt").write_bytes(b"the first run's model")
    result = gemq("run", *where, "--steps", "5", "--no-progress", cwd=tmp_path)
    line = assert_one_error(result, 1)
    assert line == ("gemq: error: runs/myexp already holds a run's results (model.pt, "
                    "summary.json); give another --run or --out, or move that folder away")
    assert (first / "model.pt").read_bytes() == b"the first run's model"
    assert sorted(p.name for p in first.iterdir()) == ["model.pt", "summary.json"]


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    result = gemq("run", "--out", "file/run", "--steps", "5", "--no-progress", cwd=tmp_path)
    line = assert_one_error(result, 1)
    assert line == "gemq: error: cannot write the run's folder file/run: Not a directory"


def test_serve_needs_a_redis_url(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No silent attachment to whatever answers on 127.0.0.1:6379."""
    monkeypatch.delenv("GEMQ_REDIS_URL", raising=False)
    result = in_process(capsys, "serve", "--port", str(free_port()))
    line = assert_one_error(result, 2)
    assert line == ("gemq: error: --redis-url: required for 'gemq serve' (or set "
                    "GEMQ_REDIS_URL); or --local: a private Redis with an aggregator and "
                    "workers")


def test_serve_local_and_a_redis_url_exclude_each_other(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    result = in_process(capsys, "serve", "--local", "--redis-url", "redis://127.0.0.1:1")
    line = assert_one_error(result, 2)
    assert line == ("gemq: error: --local: starts a private Redis: give it or --redis-url, "
                    "not both")


def test_serve_on_a_port_in_use_is_one_line(redis_server: EmbeddedRedis) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = gemq("serve", "--redis-url", redis_server.url, "--port", str(port))
    line = assert_one_error(result, 1)
    assert line == (f"gemq: error: cannot listen on 127.0.0.1:{port}: Address already in use "
                    "(another gemq serve? choose a port with --port or GEMQ_PORT)")


def test_unknown_model_writes_nothing(redis_server: EmbeddedRedis,
                                      redis_client: redis.Redis) -> None:
    result = gemq("create", "--model", "nope", "--dataset", "digits",
                  "--redis-url", redis_server.url)
    line = assert_one_error(result, 1)
    assert line == ("gemq: error: unknown model 'nope': use one of cnn, resnet, mlp, logreg, "
                    "transformer or 'package.module:factory'")
    assert redis_client.keys("*") == []


def test_unimportable_model_factory(redis_server: EmbeddedRedis, redis_client: redis.Redis,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(capsys, "create", "--model", "gemq_no_such_module:net",
                        "--dataset", "digits", "--redis-url", redis_server.url)
    line = assert_one_error(result, 1)
    assert line.startswith("gemq: error: model 'gemq_no_such_module:net': cannot import "
                           "'gemq_no_such_module': ModuleNotFoundError")
    assert redis_client.keys("*") == []


def test_cnn_on_digits_suggests_mlp(redis_server: EmbeddedRedis,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    result = in_process(capsys, "create", "--dataset", "digits", "--redis-url",
                        redis_server.url)
    line = assert_one_error(result, 1)
    assert line == ("gemq: error: model 'cnn' needs 28x28 inputs; this dataset has 64 "
                    "features (try --model mlp)")


def test_aggregator_without_redis_url_names_the_env_variable() -> None:
    line = assert_one_error(gemq("aggregator", "--run", "r1"), cli.EXIT_USAGE)
    assert line == ("gemq: error: --redis-url: required for 'gemq aggregator' "
                    "(or set GEMQ_REDIS_URL)")


@pytest.mark.parametrize("command", ["worker", "status"])
def test_missing_redis_url_in_other_commands(command: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    line = assert_one_error(in_process(capsys, command, "--run", "r1"), cli.EXIT_USAGE)
    assert line == (f"gemq: error: --redis-url: required for 'gemq {command}' "
                    "(or set GEMQ_REDIS_URL)")


# --- against a real Redis ----------------------------------------------------------------


def test_status_of_missing_run(redis_server: EmbeddedRedis) -> None:
    result = gemq("status", "--run", "nosuch", "--redis-url", redis_server.url)
    line = assert_one_error(result, 1)
    assert line == "gemq: error: no run 'nosuch' in Redis"
    assert result.stdout == ""


def test_redis_url_from_environment(redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GEMQ_REDIS_URL", redis_server.url)
    result = in_process(capsys, "status", "--run", "nosuch")
    assert assert_one_error(result, 1) == "gemq: error: no run 'nosuch' in Redis"


@pytest.mark.slow
def test_create_then_status(redis_server: EmbeddedRedis) -> None:
    created = gemq("create", "--run", "cli-1", "--model", "logreg", "--dataset", "digits",
                   "--steps", "7", "--lr", "0.2", "--redis-url", redis_server.url)
    assert (created.returncode, created.stdout, created.stderr) == (0, "cli-1\n", "")
    again = gemq("create", "--run", "cli-1", "--model", "logreg", "--dataset", "digits",
                 "--redis-url", redis_server.url)
    assert "cli-1" in assert_one_error(again, 1)
    status = gemq("status", "--run", "cli-1", "--redis-url", redis_server.url)
    assert (status.returncode, status.stderr) == (0, "")
    report = json.loads(status.stdout)
    assert (report["run_id"], report["state"], report["version"]) == ("cli-1", "created", 0)
    assert (report["updates_applied"], report["published"], report["workers"]) == (0, 0, {})


def test_unreachable_redis_names_the_url_without_its_password() -> None:
    port = free_port()
    url = f"redis://:secret@127.0.0.1:{port}"
    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        connect(url, wait_s=1)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert message.startswith(f"cannot reach Redis at redis://:***@127.0.0.1:{port} within 1 s (")
    assert "secret" not in message


@pytest.mark.parametrize("command", [("run", "--steps", "10", "--out", "out"),
                                     ("status", "--run", "r")], ids=["run", "status"])
def test_an_unreachable_redis_is_one_warning_then_one_error_naming_the_fix(
        tmp_path: Path, command: tuple[str, ...]) -> None:
    """A wrong --redis-url: one warning saying how long gemq waits, then one error line with
    what to check; nothing written before it (it used to be 31 s and 18 warnings)."""
    url = f"redis://127.0.0.1:{free_port()}"
    result = gemq(*command, "--redis-url", url, cwd=tmp_path)
    assert "Traceback" not in result.stderr and result.returncode == 1, result.stderr
    warning, error = result.stderr.splitlines()
    assert warning.endswith(f"WARNING gemq.state.connection: Redis at {url} not reachable "
                            "(Error 111 connecting to 127.0.0.1:{}. Connection refused.); "
                            "waiting up to 5 s".format(url.rsplit(":", 1)[1]))
    assert re.fullmatch(
        rf"gemq: error: cannot reach Redis at {url} within 5 s \(\d+ attempts\): .*Connection "
        r"refused\. Check that a Redis server runs there and that --redis-url \(or "
        r"GEMQ_REDIS_URL\) names it", error), error
    assert not (tmp_path / "out").exists()


def test_invalid_url_is_refused_without_its_password() -> None:
    with pytest.raises(RedisUnavailable) as info:
        connect("http://user:secret@example.invalid:6379", wait_s=1)
    assert str(info.value).startswith(
        "invalid Redis URL 'http://user:***@example.invalid:6379'")
    assert "secret" not in str(info.value)


def test_wrong_password_is_not_retried() -> None:
    with EmbeddedRedis(password="right") as server:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        started = time.monotonic()
        with pytest.raises(RedisUnavailable) as info:
            connect(url, wait_s=10)
        assert time.monotonic() - started < 5
    assert str(info.value).startswith(
        f"Redis at redis://:***@127.0.0.1:{server.port}/0 refused the credentials")
    assert "wrong" not in str(info.value)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:pw@h:1/2", "redis://:***@h:1/2"),
    ("rediss://alice:pw@h/0", "rediss://alice:***@h/0"),
])
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


# --- environment defaults (in process: faster) ------------------------------------------


def test_env_name_is_the_long_flag_in_capitals() -> None:
    run = _subparser(cli.build_parser(), "run")
    names = {action.option_strings[-1]: env_name(action) for action in run._actions}
    assert names["--redis-url"] == "GEMQ_REDIS_URL"
    assert names["--pi-max"] == "GEMQ_PI_MAX"
    assert names["--run"] == "GEMQ_RUN"
    assert names["--help"] is None


def test_apply_env_defaults_with_a_dict() -> None:
    parser = cli.build_parser()
    run = _subparser(parser, "run")
    apply_env_defaults(run, {"GEMQ_LR": "0.2", "GEMQ_BATCH_SIZE": "16",
                             "GEMQ_ALGO": "downpour", "GEMQ_NO_PROGRESS": "yes",
                             "GEMQ_OUT": "/tmp/gemq-out", "GEMQ_WORKERS": "3",
                             "GEMQ_UNRELATED": "ignored", "LR": "9"})
    args = parser.parse_args(["run"])
    assert (args.lr, args.batch_size, args.algo) == (0.2, 16, "downpour")
    assert (args.no_progress, args.out, args.workers) == (True, Path("/tmp/gemq-out"), 3)
    assert isinstance(args.batch_size, int)
    assert not hasattr(args, "unrelated")
    flags = parser.parse_args(["run", "--lr", "0.3", "--batch-size", "8", "--algo", "gem"])
    assert (flags.lr, flags.batch_size, flags.algo) == (0.3, 8, "gem")
    assert flags.workers == 3


def test_defaults_without_environment() -> None:
    args = cli.build_parser().parse_args(["run"])
    # The learning rate is the optimizer's unless given (gemq.config.DEFAULT_LR).
    assert (args.lr, args.batch_size, args.algo, args.workers) == ("auto", 64, "gem", 4)
    assert (args.redis_url, args.no_progress, args.steps, args.epochs) == (None, False, None,
                                                                            None)


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("TRUE", True), (" on ", True),
                                            ("0", False), ("no", False), ("", False)])
def test_env_booleans(raw: str, value: bool) -> None:
    parser = cli.build_parser()
    apply_env_defaults(_subparser(parser, "run"), {"GEMQ_NO_PROGRESS": raw})
    assert parser.parse_args(["run"]).no_progress is value


@pytest.mark.parametrize(("environ", "field"), [
    ({"GEMQ_NO_PROGRESS": "maybe"}, "GEMQ_NO_PROGRESS"),
    ({"GEMQ_BATCH_SIZE": "0"}, "GEMQ_BATCH_SIZE"),
    ({"GEMQ_BATCH_SIZE": "2.5"}, "GEMQ_BATCH_SIZE"),
    ({"GEMQ_LR": "fast"}, "GEMQ_LR"),
    ({"GEMQ_WIRE_DTYPE": "int8"}, "GEMQ_WIRE_DTYPE"),
])
def test_bad_env_values_name_the_variable(environ: dict[str, str], field: str) -> None:
    parser = cli.build_parser()
    with pytest.raises(ConfigError) as info:
        apply_env_defaults(_subparser(parser, "run"), environ)
    assert info.value.field == field


def test_os_environ_becomes_defaults_of_every_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMQ_REDIS_URL", "redis://example:1/0")
    monkeypatch.setenv("GEMQ_LR", "0.25")
    parser = cli.build_parser()
    assert parser.parse_args(["status", "--run", "r"]).redis_url == "redis://example:1/0"
    assert parser.parse_args(["worker", "--run", "r"]).redis_url == "redis://example:1/0"
    assert parser.parse_args(["create"]).lr == 0.25
    assert parser.parse_args(["create", "--lr", "0.5"]).lr == 0.5
    overridden = parser.parse_args(["status", "--run", "r", "--redis-url", "redis://x:2/0"])
    assert overridden.redis_url == "redis://x:2/0"


def test_main_reports_bad_env_in_process(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GEMQ_MAX_PENDING", "-3")
    assert cli.main(["create", "--run", "r"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err == "gemq: error: GEMQ_MAX_PENDING: invalid value '-3': must be in [1, 1e+06], " \
                  "got -3\n"


def test_a_bad_variable_breaks_only_the_commands_that_read_it() -> None:
    """GEMQ_NO_PROGRESS=maybe used to fail every command, --help included."""
    env = _clean_env(GEMQ_NO_PROGRESS="maybe")
    for help_ in (["--help"], ["run", "--help"], ["status", "--help"]):
        shown = gemq(*help_, env=env)
        assert shown.returncode == 0 and shown.stdout.startswith("usage: gemq"), shown.stderr
    line = assert_one_error(gemq("run", env=env), cli.EXIT_USAGE)
    assert line == "gemq: error: GEMQ_NO_PROGRESS: expected true or false, got 'maybe'"
    # status has no --no-progress: its own error, the missing run, is the one it reports.
    line = assert_one_error(gemq("status", env=env), cli.EXIT_USAGE)
    assert line.startswith("gemq: error: --run: required for 'gemq status'")


def test_env_can_supply_the_run_of_a_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers configure gemq by environment alone, the run id included."""
    monkeypatch.setenv("GEMQ_RUN", "from-env")
    parser = cli.build_parser()
    assert parser.parse_args(["status", "--redis-url", "redis://x:1/0"]).run_id == "from-env"


def test_env_can_set_the_global_verbose_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The help text promises that every flag can be set as GEMQ_<FLAG>."""
    monkeypatch.setenv("GEMQ_VERBOSE", "1")
    assert cli.build_parser().parse_args(["status", "--run", "r"]).verbose is True


# --- tab completion (the completion extra) -----------------------------------------------

COMPLETE = """
eval "$(register-python-argcomplete gemq)"
for line in "gemq ex" "gemq export --fo" "gemq export --format "; do
    COMP_LINE="$line" COMP_POINT=${#line}
    _python_argcomplete gemq
    printf '%s|' "${COMPREPLY[@]}"; echo
done
"""


def test_tab_completion_in_bash_after_the_readme_command() -> None:
    pytest.importorskip("argcomplete")
    bin_dir = str(Path(sys.executable).parent)  # gemq and register-python-argcomplete
    env = _clean_env(PATH=bin_dir + os.pathsep + os.environ["PATH"])
    out = subprocess.run(["bash", "-c", COMPLETE], capture_output=True, text=True, env=env,
                         timeout=60, check=True)
    assert out.stdout.splitlines() == ["export |", "--format |", "csv|jsonl|"]


# --- gemq rm -------------------------------------------------------------------------------


def test_rm_deletes_an_ended_run(redis_server: EmbeddedRedis, redis_client: redis.Redis,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    store = small_run(redis_client, "done")
    store.set_status(state="finished")
    result = in_process(capsys, "rm", "--run", "done", "--redis-url", redis_server.url)
    assert (result.returncode, result.stdout, result.stderr) == (
        0, "deleted run done (7 keys)\n", "")
    assert list(redis_client.scan_iter()) == []
    again = in_process(capsys, "rm", "--run", "done", "--redis-url", redis_server.url)
    assert assert_one_error(again, 1) == "gemq: error: no run 'done' in Redis"


def test_rm_refuses_a_running_run_and_forces_only_an_abandoned_one(
        redis_server: EmbeddedRedis, redis_client: redis.Redis,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = small_run(redis_client, "live")
    store.mark_running("an aggregator that died")
    store.heartbeat("w1")
    args = ("rm", "--run", "live", "--redis-url", redis_server.url)
    line = assert_one_error(in_process(capsys, *args), 1)
    assert line == ("gemq: error: run 'live' is running: stop it first (the dashboard, or "
                    "POST /api/runs/live/stop); or, if its aggregator and workers are gone, "
                    "delete it with --force")
    line = assert_one_error(in_process(capsys, *args, "--force"), 1)
    assert "worker 'w1' was heard from within the run's worker timeout" in line
    assert Leadership(store, "a live aggregator", 5000).acquire()
    line = assert_one_error(in_process(capsys, *args, "--force"), 1)
    assert "held by an aggregator" in line and "--force" not in line
    Leadership(store, "a live aggregator", 5000).release()
    redis_client.zadd(store.keys.workers, {"w1": 0})  # last heard from long ago
    result = in_process(capsys, *args, "--force")
    assert result.returncode == 0 and result.stdout.startswith("deleted run live ("), result
    assert list(redis_client.scan_iter()) == []


def test_rm_needs_a_valid_run_id(redis_server: EmbeddedRedis, redis_client: redis.Redis,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    small_run(redis_client, "kept")
    line = assert_one_error(in_process(capsys, "rm", "--run", "*", "--redis-url",
                                       redis_server.url), 1)
    assert line == "gemq: error: no run '*': not a valid run id"
    line = assert_one_error(in_process(capsys, "rm", "--redis-url", redis_server.url),
                            cli.EXIT_USAGE)
    assert line == "gemq: error: --run: required for 'gemq rm' (or set GEMQ_RUN)"
    assert RunStore(redis_client, "kept").exists()
