"""gemq.state.bulkreads: large replies read in place, against a real redis-server; broken replies
against a socket that stops or lies part-way through one.

The tests through ``connect`` run twice: with the in-place parser, and with redis-py's own
parser, which gemq's connections read with where redis-py lacks what the in-place one needs
(gemq/state/redispy.py; forced here by its switch). The in-place run is skipped, naming what
is missing, where this redis-py has not got it (tests/test_redis_internals.py fails if that
is the release the images pin)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.running.embedded import EmbeddedRedis
from gemq.state import redispy
from gemq.state.bulkreads import LARGE, InPlaceParser
from gemq.state.connection import connect
from gemq.state.store import RunStore

#: redis-py allows its maintenance notifications only with its own parsers.
NO_MAINTENANCE = redispy.maint_notifications_off()
#: Why the in-place parser cannot be used with this redis-py (None: it can).
MISSING = redispy.in_place_reads_missing()
needs_in_place = pytest.mark.skipif(
    MISSING is not None, reason=f"redis-py {redis.__version__} lacks {MISSING}")


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture(params=[pytest.param(True, id="in place", marks=needs_in_place),
                        pytest.param(False, id="redis-py's parser")])
def in_place(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether ``connect``'s clients read large replies in place (else as redis-py does
    where bulkreads cannot work)."""
    monkeypatch.setattr(redispy, "allow_in_place_reads", request.param)
    return bool(request.param)


@pytest.fixture
def client(server: EmbeddedRedis, in_place: bool) -> Iterator[redis.Redis]:
    r = connect(server.url)
    r.flushall()
    yield r
    r.close()


def value(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_connect_reads_with_the_in_place_parser_or_redis_pys(client: redis.Redis,
                                                             in_place: bool) -> None:
    connection = client.connection_pool.get_connection()
    try:
        assert isinstance(connection._parser, InPlaceParser) == in_place
    finally:
        client.connection_pool.release(connection)


def test_large_values_come_back_whole_and_read_only(client: redis.Redis, in_place: bool) -> None:
    for size in (LARGE, LARGE + 1, 3 * LARGE + 12_345):
        expected = value(size, size)
        client.set("v", expected)
        got = client.get("v")
        if in_place:
            assert isinstance(got, memoryview) and got.readonly
        else:
            assert type(got) is bytes
        assert len(got) == size and got == expected and bytes(got) == expected
        array = np.frombuffer(got, np.uint8)
        assert not array.flags.writeable
        with pytest.raises(ValueError):
            array[0] = 1


def test_small_values_stay_bytes(client: redis.Redis) -> None:
    client.set("small", value(LARGE - 1))
    client.set("empty", b"")
    assert type(client.get("small")) is bytes and len(client.get("small")) == LARGE - 1
    assert client.get("empty") == b"" and client.get("missing") is None


def test_a_pipeline_mixing_large_small_and_errors_keeps_its_order(client: redis.Redis) -> None:
    big = [value(LARGE + k * 1000, k) for k in range(3)]
    client.lpush("list", b"x")
    pipe = client.pipeline(transaction=False)
    pipe.set("a", big[0]).set("b", big[1]).set("c", big[2])
    pipe.get("a").incr("counter").get("list").get("b").get("missing").get("c")
    replies = pipe.execute(raise_on_error=False)
    assert replies[3] == big[0] and replies[4] == 1
    assert isinstance(replies[5], redis.ResponseError)  # WRONGTYPE, between two large ones
    assert replies[6] == big[1] and replies[7] is None and replies[8] == big[2]


def test_large_stream_entries_nested_in_a_reply(client: redis.Redis) -> None:
    payloads = [value(LARGE * 2 + k, 10 + k) for k in range(3)]
    for payload in payloads:
        client.xadd("s", {"g": payload, "w": "worker-1"})
    entries = client.xrange("s")
    assert [fields[b"g"] for _, fields in entries] == payloads
    assert all(fields[b"w"] == b"worker-1" for _, fields in entries)


@needs_in_place
@pytest.mark.parametrize("read_size", [4096, 8 * LARGE])
def test_any_share_of_a_value_already_buffered(server: EmbeddedRedis, read_size: int) -> None:
    # 4 KiB: almost all of each value comes straight from the socket; 8 MiB: several whole
    # values and the replies after them arrive in one read, before the parser asks.
    r = redis.Redis.from_url(server.url, parser_class=InPlaceParser, socket_read_size=read_size,
                             **NO_MAINTENANCE)
    try:
        values = [value(LARGE + 7 * k, 20 + k) for k in range(4)]
        for k, v in enumerate(values):
            r.set(f"k{k}", v)
        pipe = r.pipeline(transaction=False)
        for k in range(4):
            pipe.get(f"k{k}").ping()
        replies = pipe.execute()
        assert replies[0::2] == values and all(replies[1::2])
    finally:
        r.close()


class OneReplyServer:
    """A TCP server that answers the first command of each connection with ``reply``, then
    either closes the connection or keeps it open, silent."""

    def __init__(self, reply: bytes, close: bool) -> None:
        self.reply, self.close = reply, close
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            # Held before use: a client that gave up (its 0.5 s timeout on a loaded machine)
            # breaks the send below, and stop() must still close this end.
            self.held.append(conn)
            with contextlib.suppress(OSError):
                conn.recv(65536)
                conn.sendall(self.reply)
                if self.close:
                    conn.shutdown(socket.SHUT_RDWR)

    def client(self) -> redis.Redis:
        # RESP2: the client sends no HELLO before its command.
        return redis.Redis.from_url(f"redis://127.0.0.1:{self.port}", protocol=2,
                                    socket_timeout=0.5, retry=Retry(NoBackoff(), 0),
                                    parser_class=InPlaceParser, **NO_MAINTENANCE)

    def stop(self) -> None:
        # shutdown wakes the accept() that close alone leaves blocked.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=10)
        self.listener.close()
        for conn in self.held:
            conn.close()


@needs_in_place
@pytest.mark.parametrize("close", [True, False], ids=["connection closed", "server stalls"])
def test_a_reply_cut_short_is_a_connection_error_naming_it(close: bool) -> None:
    size = 3 * LARGE
    fake = OneReplyServer(b"$%d\r\n" % size + bytes(size // 2), close=close)
    r = fake.client()
    try:
        with pytest.raises(redis.ConnectionError, match=f"reading a {size}-byte reply"):
            r.get("v")
        assert r.connection_pool._available_connections[0]._sock is None  # dropped
    finally:
        r.close()
        fake.stop()


@needs_in_place
def test_a_bulk_string_without_its_terminator_is_a_protocol_error() -> None:
    size = LARGE
    fake = OneReplyServer(b"$%d\r\n" % size + bytes(size) + b"XX", close=False)
    r = fake.client()
    try:
        with pytest.raises(redis.exceptions.InvalidResponse, match="not followed by CRLF"):
            r.get("v")
    finally:
        r.close()
        fake.stop()


def test_a_layout_of_a_megabyte_and_more_reads_back(client: redis.Redis, in_place: bool) -> None:
    """Text values of that size (a model of tens of thousands of tensors) arrive as
    memoryviews too: the run's layout still reads back."""
    layout = ParamLayout.from_shapes([(f"block{i:05d}.attention.projection.weight", (2,))
                                      for i in range(40_000)])
    store = RunStore(client, "many-tensors")
    store.create(RunConfig(run_id="many-tensors"), layout, np.zeros(layout.size, np.float32))
    assert len(layout.to_json()) > LARGE
    assert isinstance(client.get(store.keys.layout), memoryview if in_place else bytes)
    assert store.layout().to_json() == layout.to_json()
    assert store.config().run_id == "many-tensors"


def test_the_parameters_of_an_11m_parameter_model_read_back(client: redis.Redis,
                                                            in_place: bool) -> None:
    """44 MB of float32 parameters, as a worker loads them (RunStore.latest), and a gradient
    of that size read from the stream as an aggregator does (XREADGROUP)."""
    size = 11_000_000
    params = np.random.default_rng(7).standard_normal(size, dtype=np.float32)
    layout = ParamLayout.from_shapes([("weight", (size,))])
    store = RunStore(client, "eleven-million")
    store.create(RunConfig(run_id="eleven-million"), layout, params)
    version, got = store.latest()
    assert version == 0 and got.dtype == np.dtype("<f4") and np.array_equal(got, params)
    assert isinstance(client.get(store.keys.params(0)), memoryview if in_place else bytes)

    gradient = params[::-1].tobytes()
    assert len(gradient) == 44_000_000
    client.xgroup_create("gradients", "aggregators", id="0", mkstream=True)
    client.xadd("gradients", {"w": "worker-1", "g": gradient})
    (_, [(_, fields)]), = client.xreadgroup("aggregators", "a", {"gradients": ">"}, count=1)
    assert fields[b"w"] == b"worker-1" and fields[b"g"] == gradient
    assert isinstance(fields[b"g"], memoryview if in_place else bytes)
