"""``--config FILE`` (gemq/configfile.py): flags from TOML, and the file each run leaves."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from gemq import cli
from gemq.configfile import apply_config_file, read_config_file, write_config_file
from gemq.running.local import train
from tests.test_cli import assert_one_error, in_process


def _parse(tmp_path: Path, text: str, *argv: str) -> argparse.Namespace:
    path = tmp_path / "run.toml"
    path.write_text(text)
    parser = cli.build_parser()
    full = ["run", "--config", str(path), *argv]
    apply_config_file(parser.commands["run"], path, full)
    return parser.parse_args(full)


def test_the_file_sets_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    args = _parse(tmp_path, 'lr = 0.2\nbatch-size = 16\nalgo = "downpour"\n'
                            "no_progress = true\nsteps = 40\nworkers = 3\n", "--lr", "0.3")
    assert (args.lr, args.batch_size, args.algo) == (0.3, 16, "downpour")
    assert (args.no_progress, args.steps, args.workers) == (True, 40, 3)
    assert isinstance(args.batch_size, int)


def test_a_budget_on_the_command_line_replaces_the_files(tmp_path: Path) -> None:
    args = _parse(tmp_path, "steps = 40\n", "--epochs", "2")
    assert (args.steps, args.epochs) == (None, 2.0)


def test_the_file_wins_over_the_environment(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMQ_LR", "0.7")
    monkeypatch.setenv("GEMQ_KAPPA", "3")
    args = _parse(tmp_path, "lr = 0.2\n")
    assert (args.lr, args.kappa) == (0.2, 3.0)


@pytest.mark.parametrize(("text", "line"), [
    ("lrr = 1\n", "gemq: error: {path}: lrr: not a flag of this command; it has: "),
    ('lr = "fast"\n', "gemq: error: {path}: lr: invalid value 'fast': could not convert "
                      "string to float: 'fast'"),
    ("batch-size = 0\n", "gemq: error: {path}: batch-size: invalid value '0': must be "),
    ("no-progress = 3\n", "gemq: error: {path}: no-progress: expected true or false, got '3'"),
    ("lr = [1, 2]\n", "gemq: error: {path}: lr: must be a number, a string or true/false, "
                      "not a table or an array"),
    ("lr = \n", "gemq: error: --config: {path} is not valid TOML: "),
    (None, "gemq: error: --config: cannot read {path}: No such file or directory"),
], ids=["unknown key", "bad number", "out of range", "bad switch", "array", "bad toml",
        "missing"])
def test_a_bad_file_is_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None,
        line: str) -> None:
    path = tmp_path / "run.toml"
    if text is not None:
        path.write_text(text)
    result = in_process(capsys, "run", "--config", str(path), "--out", str(tmp_path / "out"))
    assert assert_one_error(result, 2).startswith(line.format(path=path))
    assert not (tmp_path / "out").exists()


def test_written_values_read_back_as_they_were(tmp_path: Path) -> None:
    values = {"name": 'a "quoted" \\ path/é\ttab', "small": 1e-06, "big": 1e300,
              "whole": 3, "negative": -2.5, "on": True, "off": False, "infinite": float("inf"),
              "missing": None}
    path = write_config_file(tmp_path / "c.toml", values, "two\nlines")
    assert path.read_text().startswith("# two\n# lines\n")
    back = read_config_file(path)
    assert back == {k: v for k, v in values.items() if v is not None}
    assert type(back["whole"]) is int and type(back["small"]) is float


def test_a_runs_config_toml_gives_the_same_run_again(tmp_path: Path) -> None:
    summary = train("logreg", "digits", workers=2, steps=20, lr=0.02, kappa=2.0, seed=7,
                    wire_dtype="bfloat16", run_id="first", out_dir=tmp_path / "first",
                    progress=False)
    path = tmp_path / "first" / "config.toml"
    parser = cli.build_parser()
    argv = ["run", "--config", str(path), "--run", "second"]
    apply_config_file(parser.commands["run"], path, argv)
    args = parser.parse_args(argv)
    assert (args.workers, args.device) == (2, "cpu")
    again = cli._run_settings(args)
    expected = dataclasses.asdict(summary.config)
    for name, value in again.items():
        if name == "steps":
            assert value == summary.config.budget_updates == 20
        elif name == "run_id":
            assert value == "second"
        elif name != "epochs":
            assert value == expected[name], name
    assert again["epochs"] is None

