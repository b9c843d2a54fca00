"""What gemq uses of redis-py beyond its documented API, checked here and used only where present.

Two fast paths reach into redis-py's internals. Large replies are read in place
(gemq/state/bulkreads.py subclasses its private RESP3 parser and socket buffer), and commands
with large arguments are sent without being packed into one more copy
(gemq/state/connection.py's ZeroCopyPacker uses its serializer classes, through the
connections' ``command_packer`` argument). None of that is API, and it changes between
releases: the socket buffer's ``_live_buffer()``, which bulkreads reads through, first
appeared in redis-py 8.2 (with 8.1, before this check, every reply of 1 MiB or more
failed). So each fast path is taken only where the installed redis-py has everything it
uses (the names, with the parameters gemq passes), checked here by feature, not by version
number; elsewhere gemq leaves that part to redis-py (its own parser, its own packing:
copies, but correct) and says so once, at debug level. Its maintenance notifications (7.0
and later; a Redis Enterprise feature, allowed only with its own parsers) are turned off
where it has them. tests/test_redis_internals.py lists every name relied on and requires
both fast paths with the redis-py release the images pin (docker/constraints.txt).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import redis

log = logging.getLogger(__name__)

#: False: connections read with redis-py's own parser even where the in-place one works
#: (the tests run the large-reply path both ways).
allow_in_place_reads = True


def in_place_parser() -> type[Any] | None:
    """bulkreads.InPlaceParser where this redis-py has what it needs, else None: redis-py's
    own parser (hiredis' where installed) reads, with its copies."""
    return _in_place_parser() if allow_in_place_reads else None


def zero_copy_packing() -> bool:
    """Whether connections can take connection.ZeroCopyPacker as their ``command_packer``;
    if not, redis-py packs every command into one copy of its own."""
    return _zero_copy_packing()


def maint_notifications_off() -> dict[str, Any]:
    """The connection argument that turns redis-py's maintenance notifications off (it
    allows them only with its own parsers; gemq has no use for them), where redis-py has
    them (7.0 and later)."""
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def in_place_reads_missing() -> str | None:
    """What bulkreads needs of redis-py's internals and this redis-py lacks (None: nothing).

    bulkreads.InPlaceParser is redis-py's ``_RESP3Parser`` whose ``on_connect`` swaps the
    ``SocketBuffer`` (built from ``_sock``, ``socket_read_size`` and the connection's
    timeout) for a subclass; its ``read(length, timeout)`` takes what ``_live_buffer()``
    holds of a large value, then the rest straight from ``_sock``, restoring
    ``socket_timeout`` after a timeout given with the call (``SENTINEL``: none given).
    """
    try:
        from redis._parsers import _RESP3Parser
        from redis._parsers.socket import SocketBuffer

        import gemq.state.bulkreads  # noqa: F401  (imports the rest it needs)
    except ImportError as e:
        return str(e)
    read = getattr(SocketBuffer, "read", None)
    if not callable(read) or list(inspect.signature(read).parameters)[1:3] != ["length",
                                                                                "timeout"]:
        return "SocketBuffer.read(length, timeout)"
    for cls, method in ((SocketBuffer, "_live_buffer"), (_RESP3Parser, "on_connect")):
        if not callable(getattr(cls, method, None)):
            return f"{cls.__name__}.{method}()"
    try:
        buffer = SocketBuffer(None, 1, None)  # type: ignore[arg-type]
        parser = _RESP3Parser(1)
        live = buffer._live_buffer()
    except Exception as e:  # a changed constructor or method: whatever it raises
        return (f"SocketBuffer(socket, read_size, timeout)._live_buffer(), "
                f"_RESP3Parser(read_size): {e!r}")
    needed = [(buffer, "_sock"), (buffer, "socket_timeout"), (live, "readinto"),
              (parser, "_sock"), (parser, "socket_read_size")]
    missing = [f"{type(o).__name__}.{name}" for o, name in needed if not hasattr(o, name)]
    live.close()
    return ", ".join(missing) or None


def zero_copy_packing_missing() -> str | None:
    """What ZeroCopyPacker needs of redis-py and this redis-py lacks (None: nothing): its
    serializers, the encoder they take, and the connections' ``command_packer`` argument."""
    try:
        from redis.connection import (  # noqa: F401
            HIREDIS_AVAILABLE,
            AbstractConnection,
            Encoder,
            HiredisRespSerializer,
            PythonRespSerializer,
        )
    except ImportError as e:
        return str(e)
    if "command_packer" not in inspect.signature(AbstractConnection.__init__).parameters:
        return "the connections' command_packer argument"
    try:
        PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode).pack("PING")
    except Exception as e:  # a changed constructor or method: whatever it raises
        return f"PythonRespSerializer(buffer_cutoff, encode).pack(): {e!r}"
    return None


@functools.cache
def _in_place_parser() -> type[Any] | None:
    missing = in_place_reads_missing()
    if missing:
        log.debug("redis-py %s lacks what reading large replies in place needs (%s): its own "
                  "parser reads them, with its copies", redis.__version__, missing)
        return None
    from gemq.state.bulkreads import InPlaceParser
    return InPlaceParser


@functools.cache
def _zero_copy_packing() -> bool:
    missing = zero_copy_packing_missing()
    if missing:
        log.debug("redis-py %s lacks what sending large arguments without a copy needs (%s): "
                  "it packs every command itself", redis.__version__, missing)
    return missing is None
