"""A slow or hostile Redis: replies that trickle in and bulk lengths no server could mean.
A real redis-server behind a proxy the test slows down, and a small fake RESP server, both
in this process; gemq's client, `gemq status` and the API service against them."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from gemq.running.embedded import EmbeddedRedis
from gemq.state import redispy
from gemq.state.connection import connect
from tests.helpers import small_run
from tests.test_api import TOKEN, start_api
from tests.test_cli import assert_one_error, in_process


class _Server:
    """A listening socket on a free port whose connections ``serve`` handles, each in a
    thread of its own."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_quietly, args=(conn,), daemon=True).start()

    def _serve_quietly(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


class TrickleProxy(_Server):
    """Passes commands to a real Redis and its replies back: at once, or, once ``slow`` is
    set, a byte every ``delay_s``."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port, self.delay_s, self.slow = target_port, delay_s, threading.Event()
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        with socket.create_connection(("127.0.0.1", self.target_port)) as upstream:
            threading.Thread(target=self._commands, args=(conn, upstream),
                             daemon=True).start()
            while data := upstream.recv(65536):
                if not self.slow.is_set():
                    conn.sendall(data)
                    continue
                for i in range(len(data)):
                    conn.sendall(data[i:i + 1])
                    time.sleep(self.delay_s)

    @staticmethod
    def _commands(conn: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                upstream.sendall(data)


class BulkLengthServer(_Server):
    """Speaks enough RESP to connect (HELLO, PING, CLIENT, SELECT; INFO: not a cluster),
    then answers any other command with a bulk string of ``length`` bytes, of which it
    sends 100."""

    def __init__(self, length: int) -> None:
        self.length = length
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        pending = b""
        while data := conn.recv(65536):
            pending += data
            while pending.startswith(b"*"):
                lines = pending.split(b"\r\n")
                count = int(lines[0][1:])
                if len(lines) < 2 + 2 * count:
                    break  # the rest of the command is still on its way
                pending = b"\r\n".join(lines[1 + 2 * count:])
                conn.sendall(self._answer(lines[2].upper()))

    def _answer(self, command: bytes) -> bytes:
        if command == b"HELLO":
            return b"%2\r\n+server\r\n+redis\r\n+proto\r\n:3\r\n"
        if command == b"PING":
            return b"+PONG\r\n"
        if command in (b"CLIENT", b"SELECT"):
            return b"+OK\r\n"
        if command == b"INFO":
            info = b"# Cluster\r\ncluster_enabled:0\r\n"
            return b"$%d\r\n%s\r\n" % (len(info), info)
        return f"${self.length}\r\n".encode() + b"x" * 100


@pytest.fixture
def proxy(redis_server: EmbeddedRedis) -> Iterator[TrickleProxy]:
    server = TrickleProxy(redis_server.port, delay_s=0.2)
    yield server
    server.close()


@pytest.fixture(params=[True, False], ids=["in-place-reads", "redis-py-parser"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(redispy, "allow_in_place_reads", request.param)
    return bool(request.param)


LENGTHS = [2**62, 2**63 - 1, 2**64]


@pytest.mark.parametrize("length", LENGTHS, ids=["2^62", "2^63-1", "2^64"])
def test_a_bulk_length_no_server_could_mean_is_a_redis_error(length: int, parser: bool) -> None:
    """Was MemoryError (2^62) and ValueError (2^63-1, 2^64) from the in-place reads."""
    server = BulkLengthServer(length)
    try:
        client = connect(server.url, wait_s=5, socket_timeout_s=2, retries=0)
        with pytest.raises(redis.RedisError):
            client.get("anything")
        client.close()
    finally:
        server.close()


@pytest.mark.parametrize("length", LENGTHS, ids=["2^62", "2^63-1", "2^64"])
def test_gemq_status_says_one_line_for_a_bulk_length_no_server_could_mean(
        length: int, capsys: pytest.CaptureFixture[str]) -> None:
    server = BulkLengthServer(length)
    try:
        result = in_process(capsys, "status", "--run", "r", "--redis-url", server.url)
    finally:
        server.close()
    assert_one_error(result, 1)


def test_a_reply_that_trickles_in_is_cut_off_like_one_that_never_comes(
        proxy: TrickleProxy, redis_client: redis.Redis) -> None:
    """A 2 KB value at 5 bytes a second: every read of it gets a byte within the socket
    timeout, so only a deadline on the whole reply ends it (at that rate, some 400 s)."""
    redis_client.set("value", b"v" * 2048)
    client = connect(proxy.url, wait_s=5, socket_timeout_s=2, retries=0)
    assert client.get("value") == b"v" * 2048
    proxy.slow.set()
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.get("value")
    # The deadline is the 2 s timeout (plus a little per byte); the margin is for load.
    assert time.monotonic() - started < 20
    client.close()


def test_the_api_answers_503_when_redis_trickles(proxy: TrickleProxy,
                                                 redis_client: redis.Redis) -> None:
    """docs/deploy.md promises a 503 within about 4 s for a Redis that does not answer:
    one that answers a byte at a time took its /api/runs beyond 40 s."""
    small_run(redis_client, "r")
    api = start_api(proxy.url, GEMQ_API_TOKEN=TOKEN)
    try:
        with api.client(TOKEN) as c:
            assert c.get("/api/runs/r").status_code == 200
            proxy.slow.set()
            for path in ("/api/runs", "/api/runs/r", "/metrics"):
                started = time.monotonic()
                try:
                    reply = c.get(path, timeout=60)
                except httpx.TimeoutException:
                    pytest.fail(f"{path}: no answer within 60 s")
                took = time.monotonic() - started
                assert reply.status_code == 503, (path, reply.text)
                assert took < 20, (path, took)  # about 4 s idle; the margin is for load
    finally:
        api.process.stop()
