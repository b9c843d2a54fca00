"""A Redis reply that trickles in is cut off like one that never comes.

redis-py's ``socket_timeout`` bounds each read from the socket, so a server (or a link)
that sends a byte a second keeps a command waiting for ever: a client's call, the API's
``/api/runs``. gemq's connections wrap their socket so that the reply to a command must
come within the socket timeout plus the time its bytes take at ``MIN_BYTES_PER_S``: a
large reply over a slow link is read whole, a trickle ends in ``socket.timeout``, which
redis-py reports as its TimeoutError, an outage like a server that froze: waited out
and retried where the caller does that, a 503 from the API.

The wrapper leans on one redis-py internal, ``_connect()`` (which returns the new
socket), present with that meaning in every release pyproject.toml allows
(tests/test_redis_internals.py checks it).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import redis
from redis.connection import SSLConnection, UnixDomainSocketConnection

#: The slowest a reply may come once its first byte is late: a second per this many bytes.
MIN_BYTES_PER_S = 256 * 1024


class DeadlineSocket:
    """``sock``, whose reads after each send share one deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout: float | None = sock.gettimeout()
        # What the socket is set to now: setting it costs a system call, which a read of a
        # reply that comes in time (the deadline further off than the timeout) does without.
        self._applied = self._timeout
        self._deadline: float | None = None  # set by the first read after a send

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = self._applied = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def sendall(self, data: Any, *args: Any) -> None:
        self._deadline = None
        self._sock.sendall(data, *args)

    # The arguments go on as given, so the socket's own defaults apply (an SSL socket's
    # are not a plain one's).
    def recv(self, size: int, *flags: int) -> bytes:
        peek = _peeks(flags)
        self._before_read(peek)
        data = self._sock.recv(size, *flags)
        self._after_read(len(data), peek)
        return data

    def recv_into(self, buffer: Any, *size_and_flags: int) -> int:
        peek = _peeks(size_and_flags[1:])
        self._before_read(peek)
        got = self._sock.recv_into(buffer, *size_and_flags)
        self._after_read(got, peek)
        return got

    def _before_read(self, peek: bool) -> None:
        if self._timeout is None or self._timeout == 0 or peek:
            return  # no deadline for blocking reads without a timeout, polls and peeks
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._timeout
        left = self._deadline - now
        if left <= 0:
            raise TimeoutError(f"the reply came too slowly (under {MIN_BYTES_PER_S} "
                               "bytes/s after the socket timeout)")
        wanted = min(self._timeout, left)
        if wanted != self._applied:
            self._sock.settimeout(wanted)
            self._applied = wanted

    def _after_read(self, size: int, peek: bool) -> None:
        if self._deadline is not None and not peek:
            self._deadline += size / MIN_BYTES_PER_S

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _peeks(flags: tuple[int, ...]) -> bool:
    return bool(flags and flags[0] & socket.MSG_PEEK)


class _Deadlines:
    """A connection whose socket is a DeadlineSocket."""

    def _connect(self) -> Any:
        return DeadlineSocket(super()._connect())  # type: ignore[misc]


class DeadlineConnection(_Deadlines, redis.Connection):
    pass


class DeadlineSSLConnection(_Deadlines, SSLConnection):
    pass


class DeadlineUnixConnection(_Deadlines, UnixDomainSocketConnection):
    pass


def connection_class(url: str) -> type[redis.Connection] | type[UnixDomainSocketConnection]:
    """The connection class for ``url``'s scheme, as redis-py picks, with deadlines."""
    scheme = url.split("://", 1)[0].lower()
    if scheme == "rediss":
        return DeadlineSSLConnection
    if scheme == "unix":
        return DeadlineUnixConnection
    return DeadlineConnection


def with_deadlines(cls: type[Any]) -> type[Any]:
    """The deadline class of a connection class redis-py chose (a cluster node's)."""
    for plain, timed in ((SSLConnection, DeadlineSSLConnection),
                         (UnixDomainSocketConnection, DeadlineUnixConnection),
                         (redis.Connection, DeadlineConnection)):
        if issubclass(cls, plain) and not issubclass(cls, _Deadlines):
            return timed
    return cls
