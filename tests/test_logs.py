"""Log lines: GEMQ_LOG_FORMAT=json gives one JSON object per line, GEMQ_LOG_LEVEL filters,
and a bad value is one clear error. In this process (gemq.logs) and in a real API process
(uvicorn's own records included)."""

from __future__ import annotations

import json
import logging
import threading
import warnings
from datetime import datetime

import pytest

from gemq import cli, logs
from gemq.errors import ConfigError
from gemq.running.embedded import EmbeddedRedis
from gemq.services.settings import AggregatorServiceSettings, load
from tests.test_api import start_api


def _lines(text: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_lines_carry_time_level_logger_message_and_context(
        capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("INFO", "json")
    log = logging.getLogger("gemq.test")
    seen: list[str] = []

    def elsewhere() -> None:  # a thread of its own has a context of its own
        log.info("from a thread")
        seen.append("done")

    with logs.log_context(run="r1"):
        with logs.log_context(worker="w7"):
            log.info("step %d of %s", 3, "r1")
        log.warning("no worker here", extra={"run": "given"})
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("it failed")
    log.debug("below the level")
    step, given, threaded, failed = _lines(capsys.readouterr().err)
    assert set(step) == {"time", "level", "logger", "message", "run", "worker"}
    assert (step["level"], step["logger"], step["message"]) == ("INFO", "gemq.test",
                                                                 "step 3 of r1")
    assert (step["run"], step["worker"]) == ("r1", "w7")
    assert datetime.fromisoformat(step["time"]).tzinfo is not None  # UTC, with its Z
    assert (given["level"], given["run"], "worker" in given) == ("WARNING", "given", False)
    assert "run" not in threaded and seen == ["done"]
    assert failed["run"] == "r1" and "ValueError: boom" in failed["exception"]


def test_the_level_filters_and_warnings_become_log_lines(
        capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("WARNING", "json")
    log = logging.getLogger("gemq.test")
    log.info("dropped")
    log.warning("kept")
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # not pytest's "error"
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
    lines = _lines(capsys.readouterr().err)
    assert [(e["level"], e["logger"]) for e in lines] == [("WARNING", "gemq.test"),
                                                          ("WARNING", "py.warnings")]
    assert "a library's warning" in lines[1]["message"]


def test_text_stays_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure()
    logging.getLogger("gemq.test").info("plain")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(" INFO gemq.test: plain")


def test_bad_log_settings_are_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GEMQ_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="GEMQ_LOG_LEVEL.*DEBUG, INFO, WARNING"):
        load(AggregatorServiceSettings)
    monkeypatch.setenv("GEMQ_LOG_LEVEL", "debug")
    assert load(AggregatorServiceSettings).log_level == "DEBUG"
    monkeypatch.setenv("GEMQ_LOG_FORMAT", "xml")
    assert cli.main(["serve", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gemq: error: GEMQ_LOG_FORMAT") and "json" in line


def test_the_api_logs_json_at_its_level_uvicorn_included(redis_server: EmbeddedRedis) -> None:
    info = start_api(redis_server.url, GEMQ_LOG_FORMAT="json")
    quiet = start_api(redis_server.url, GEMQ_LOG_FORMAT="json", GEMQ_LOG_LEVEL="WARNING")
    try:
        verbose_lines, quiet_lines = _lines(info.process.output()), _lines(
            quiet.process.output())
    finally:
        info.process.stop()
        quiet.process.stop()
    loggers = {e["logger"] for e in verbose_lines}
    assert {"gemq.services.api.app", "uvicorn.error"} <= loggers, verbose_lines
    assert {e["level"] for e in quiet_lines} == {"WARNING"}, quiet_lines
    assert any("no GEMQ_API_TOKEN" in e["message"] for e in quiet_lines)
