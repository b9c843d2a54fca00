"""Reading large Redis replies straight into their own buffer.

Every gradient an aggregator applies and every parameter vector a worker loads arrives as
one bulk string of megabytes. redis-py's parsers copy such a reply two or three times after
the kernel has: hiredis appends each chunk read to a buffer that it grows by reallocation,
then copies the whole reply into a new ``bytes``; the pure-Python parser writes every chunk
into a ``BytesIO`` and reads it back out. Measured on the aggregator of an 11 M-parameter
run, those copies were about a quarter of its CPU time.

``InPlaceParser`` is redis-py's pure-Python RESP3 parser (RESP3 is what redis-py speaks
by default; RESP2 replies are a subset it reads as well) with one change: a bulk string of
at least ``LARGE`` bytes is read from the socket directly into a buffer of its exact size
(one copy, the kernel's), after whatever part of it was buffered already. Everything else
(small replies, errors, nesting) is redis-py's own code.

The buffer is a numpy array, not a ``bytearray``: numpy asks the kernel for huge pages for
large arrays, and a fresh ``bytearray`` of tens of megabytes cost several times as much to
allocate and fill as the array, nearly all of it page faults (measured in
docs/performance.md: "Large values without extra copies"). A large reply comes back as a read-only
``memoryview`` of it: the buffer protocol (``numpy.frombuffer``, msgpack, ``bytes()``),
comparison with ``bytes``, and the immutability of ``bytes`` (views of it handed to other
threads cannot be written through); no ``decode()``, and a client with
``decode_responses`` gets it undecoded.

A large read that fails part-way (timeout, connection lost) leaves the connection
mid-reply; it is reported as a ConnectionError, after which redis-py drops that connection
(it cannot be rewound like a small reply). A server too old for RESP3 makes redis-py fall
back to its RESP2 parser, and large replies are copied as before.

This subclasses redis-py's internals, which change between releases (``_live_buffer()``
first appeared in 8.2): gemq/state/redispy.py checks that the installed redis-py has all
this uses before gemq's connections take ``InPlaceParser``; where it does not, they read
with redis-py's own parser, large replies arrive as ``bytes`` after its copies, and a debug
line says so once.
"""

from __future__ import annotations

import os
from typing import Any, cast

import numpy as np
from redis import exceptions
from redis._parsers import _RESP3Parser
from redis._parsers.socket import SENTINEL, SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer

#: Bulk strings this long or longer are read in place. Smaller ones gain little (the copies
#: are cheap) and stay ``bytes``.
LARGE = 1 << 20
_CRLF = b"\r\n"
#: No reply can be larger than the machine's memory: a bulk length beyond it is refused
#: before anything is allocated.
_PHYSICAL_MEMORY = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _InPlaceBuffer(SocketBuffer):
    """redis-py's socket buffer, reading large bulk strings into a buffer of their own."""

    def read(self, length: int, timeout: float | object = SENTINEL) -> Any:
        if length < LARGE:
            return super().read(length, timeout)
        if length > _PHYSICAL_MEMORY:  # a hostile or broken server: 2^62, 2^64 ...
            raise exceptions.InvalidResponse(
                f"Protocol Error: a bulk string of {length} bytes, more than this machine's "
                f"memory ({_PHYSICAL_MEMORY} bytes)")
        try:
            out = np.empty(length + len(_CRLF), np.uint8)  # the value, then its terminator
        except (MemoryError, ValueError) as e:
            raise exceptions.InvalidResponse(
                f"a bulk string of {length} bytes does not fit in memory: {e}") from e
        view = out.data
        buffered = self._live_buffer()
        filled = buffered.readinto(view)  # what the last reads brought of it already
        try:
            self._receive_into(view[filled:], timeout)
        except (exceptions.TimeoutError, exceptions.ConnectionError) as e:
            # The socket is now somewhere inside the reply: nothing can resume from there.
            raise exceptions.ConnectionError(
                f"connection lost reading a {length}-byte reply: {e}") from e
        finally:
            view.release()
        if out[length:].tobytes() != _CRLF:
            raise exceptions.InvalidResponse(
                f"Protocol Error: a {length}-byte bulk string is not followed by CRLF")
        return out[:length].data.toreadonly()

    def _receive_into(self, view: memoryview, timeout: float | object) -> None:
        sock = self._sock
        if sock is None:
            raise exceptions.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
        if timeout is not SENTINEL:
            sock.settimeout(cast(float | None, timeout))
        try:
            while view:
                received = sock.recv_into(view)
                if received == 0:
                    raise exceptions.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                view = view[received:]
        except TimeoutError as e:  # the socket's timeout
            raise exceptions.TimeoutError("Timeout reading from socket") from e
        except OSError as e:
            raise exceptions.ConnectionError(f"Error while reading from socket: {e.args}") from e
        finally:
            if timeout is not SENTINEL:
                sock.settimeout(self.socket_timeout)


class InPlaceParser(_RESP3Parser):
    """redis-py's RESP3 parser, reading bulk strings of ``LARGE`` bytes or more in place."""

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)
        self._buffer = _InPlaceBuffer(self._sock, self.socket_read_size,
                                      connection.socket_timeout)
