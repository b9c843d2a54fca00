"""The parts of redis-py's internals gemq relies on (gemq/state/redispy.py), named one by one.

With the redis-py release the images pin (docker/constraints.txt), both fast paths must be
on: moving the pin to a release that lacks one of these names fails here. With any other
release (``make test`` installs the newest) a fast path that is off is not a failure: gemq
then reads or packs as redis-py does, which is correct (tests/test_bulkreads.py runs the
large-reply path that way too), and the test that would require it is skipped naming what
is missing. A fast path that is on must have every name listed here, and the check in
gemq/state/redispy.py must agree with this list on every release.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import redis

from gemq.running.embedded import EmbeddedRedis
from gemq.state import redispy
from gemq.state.bulkreads import InPlaceParser
from gemq.state.connection import (
    ZeroCopyPacker,
    _packing_settings,
    _reading_settings,
    connect,
)
from gemq.state.deadline import DeadlineSocket

ROOT = Path(__file__).resolve().parents[1]

#: What gemq/state/bulkreads.py uses of redis-py: module, then attribute path. ``()`` is an
#: attribute of an instance (made as bulkreads' code makes them), not of the class.
IN_PLACE_READS = [
    ("redis._parsers", "_RESP3Parser"),  # InPlaceParser's base class
    ("redis._parsers", "_RESP3Parser.on_connect"),  # makes the buffer InPlaceParser replaces
    ("redis._parsers", "_RESP3Parser()._sock"),
    ("redis._parsers", "_RESP3Parser().socket_read_size"),
    ("redis._parsers.socket", "SocketBuffer"),  # _InPlaceBuffer's base class
    ("redis._parsers.socket", "SocketBuffer.read"),  # overridden: (length, timeout)
    ("redis._parsers.socket", "SocketBuffer._live_buffer"),  # redis-py 8.2 and later
    ("redis._parsers.socket", "SocketBuffer()._live_buffer().readinto"),
    ("redis._parsers.socket", "SocketBuffer()._sock"),
    ("redis._parsers.socket", "SocketBuffer().socket_timeout"),
    ("redis._parsers.socket", "SENTINEL"),  # "no timeout given" for read()
    ("redis._parsers.socket", "SERVER_CLOSED_CONNECTION_ERROR"),
]
#: What gemq/state/connection.py's ZeroCopyPacker uses of redis-py.
ZERO_COPY_PACKING = [
    ("redis.connection", "HIREDIS_AVAILABLE"),
    ("redis.connection", "Encoder"),
    ("redis.connection", "HiredisRespSerializer"),
    ("redis.connection", "PythonRespSerializer"),
    ("redis.connection", "AbstractConnection"),  # its command_packer argument
]
#: What gemq/state/deadline.py uses of redis-py. Not a fast path with a fallback: every
#: release pyproject.toml allows must have it (the lowest-versions job runs this too).
DEADLINES = [
    ("redis.connection", "Connection._connect"),  # returns the new socket
    ("redis.connection", "SSLConnection._connect"),
    ("redis.connection", "UnixDomainSocketConnection._connect"),
]
#: Instances for the ``()`` entries: the arguments bulkreads' code makes them with.
CONSTRUCTED: dict[str, tuple[Any, ...]] = {"_RESP3Parser": (1,), "SocketBuffer": (None, 1, None),
                                           "_live_buffer": ()}


def resolve(module: str, path: str) -> Any:
    """The object at ``path`` in ``module``; AttributeError or ImportError if there is none."""
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        called = part.endswith("()")
        obj = getattr(obj, part.removesuffix("()"))
        if called:
            obj = obj(*CONSTRUCTED[part.removesuffix("()")])
    return obj


def absent(names: list[tuple[str, str]]) -> list[str]:
    """The names of the list this redis-py lacks."""
    missing = []
    for module, path in names:
        try:
            resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    return missing


def lacks_in_place_reads() -> list[str]:
    missing = absent(IN_PLACE_READS)
    if not missing:
        read = resolve("redis._parsers.socket", "SocketBuffer.read")
        if list(inspect.signature(read).parameters)[1:3] != ["length", "timeout"]:
            missing.append("SocketBuffer.read(length, timeout)")
    return missing


def lacks_zero_copy_packing() -> list[str]:
    missing = absent(ZERO_COPY_PACKING)
    if not missing:
        init = resolve("redis.connection", "AbstractConnection.__init__")
        if "command_packer" not in inspect.signature(init).parameters:
            missing.append("AbstractConnection(command_packer=)")
    return missing


def pinned_redis_py() -> str:
    pins = (ROOT / "docker" / "constraints.txt").read_text()
    match = re.search(r"^redis==(\S+)$", pins, re.MULTILINE)
    assert match, "docker/constraints.txt pins no redis release"
    return match.group(1)


def test_every_allowed_redis_py_lets_gemq_put_a_deadline_on_its_sockets(
        redis_server: EmbeddedRedis) -> None:
    assert absent(DEADLINES) == []
    client = connect(redis_server.url, wait_s=5)
    try:
        assert client.ping()
        connection = client.connection_pool.get_connection()
        try:
            assert isinstance(connection._sock, DeadlineSocket)
        finally:
            client.connection_pool.release(connection)
    finally:
        client.close()


def test_the_redis_py_the_images_pin_has_both_fast_paths() -> None:
    pinned = pinned_redis_py()
    if redis.__version__ != pinned:
        pytest.skip(f"redis-py {redis.__version__} installed; the images pin {pinned}")
    assert lacks_in_place_reads() == [] and redispy.in_place_reads_missing() is None
    assert lacks_zero_copy_packing() == [] and redispy.zero_copy_packing_missing() is None
    assert redispy.in_place_parser() is InPlaceParser and redispy.zero_copy_packing()


def _skip_unless_both_agree_it_is_on(missing: list[str], said: str | None, off: str) -> None:
    """This test's list of missing names and gemq/state/redispy.py's check agree; skip
    (saying ``off``) where the fast path is off."""
    assert (said is None) == (not missing), (
        f"gemq/state/redispy.py says {said!r}, this test's list misses {missing}")
    if missing:
        pytest.skip(f"redis-py {redis.__version__}: {off}; it lacks {', '.join(missing)}")


def test_in_place_reads_are_on_exactly_where_every_name_they_use_exists() -> None:
    _skip_unless_both_agree_it_is_on(lacks_in_place_reads(), redispy.in_place_reads_missing(),
                                     "large replies read by its own parser")
    assert redispy.in_place_parser() is InPlaceParser
    assert _reading_settings()["parser_class"] is InPlaceParser


def test_zero_copy_packing_is_on_exactly_where_every_name_it_uses_exists() -> None:
    _skip_unless_both_agree_it_is_on(lacks_zero_copy_packing(),
                                     redispy.zero_copy_packing_missing(),
                                     "commands packed its way")
    assert redispy.zero_copy_packing()
    assert isinstance(_packing_settings()["command_packer"], ZeroCopyPacker)


def test_without_in_place_reads_connections_get_redis_pys_parser(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redispy, "allow_in_place_reads", False)
    assert redispy.in_place_parser() is None
    assert "parser_class" not in _reading_settings()


def test_maintenance_notifications_are_turned_off_where_redis_py_has_them() -> None:
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:
        assert redispy.maint_notifications_off() == {}
        return
    config = redispy.maint_notifications_off()["maint_notifications_config"]
    assert isinstance(config, MaintNotificationsConfig) and not config.enabled


def test_a_fast_path_that_is_off_is_said_once_at_debug_level(
        caplog: pytest.LogCaptureFixture) -> None:
    redispy._in_place_parser.cache_clear()
    redispy._zero_copy_packing.cache_clear()
    with caplog.at_level(logging.DEBUG, logger=redispy.__name__):
        for _ in range(3):
            redispy.in_place_parser()
            redispy.zero_copy_packing()
    lines = [r for r in caplog.records if r.name == redispy.__name__]
    off = [redispy.in_place_reads_missing(), redispy.zero_copy_packing_missing()]
    assert len(lines) == sum(m is not None for m in off)
    assert all(r.levelno == logging.DEBUG and redis.__version__ in r.getMessage()
               for r in lines)
