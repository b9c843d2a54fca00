"""Opening Redis connections: bounded, logged retries and errors that name the server."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, cast
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from gemq.errors import GemqError, RedisUnavailable
from gemq.state import deadline, redispy

log = logging.getLogger(__name__)

#: Errors a Redis outage brings: a command is retried on a fresh connection after one, and
#: every gemq process waits them out. A Redis Cluster with a master down answers
#: CLUSTERDOWN (MASTERDOWN; TRYAGAIN while slots move) until it is whole again, having run
#: nothing: an outage too, not a reason to give the run up.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError,
    redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)
_UNREACHABLE: tuple[type[Exception], ...] = (*TRANSIENT_ERRORS, OSError)


#: scheme://, then the authority (up to the first /, ? or #, as urlsplit cuts it), then the rest.
_URL_PARTS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)(.*)$", re.DOTALL)
#: Query parameters whose values are secrets (matched in the lower-cased, decoded name).
_SECRET_PARAMS = ("password", "secret", "token")


def redact(url: str) -> str:
    """The URL with every password replaced by ``***``, for logs and error messages.

    Both places redis-py reads one from are covered: the userinfo (``user:password@``) and
    query parameters (``?password=``, ``ssl_password=``). Works on the text alone, so a
    malformed URL (a port out of range, a broken IPv6 address) is redacted too: this runs
    while reporting exactly such errors and must never raise.
    """
    match = _URL_PARTS.match(url)
    if match is None:
        return _redact_query(url)
    scheme, authority, rest = match.groups()
    return scheme + _redact_userinfo(authority) + _redact_query(rest)


def _redact_userinfo(authority: str) -> str:
    userinfo, at, host = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return authority  # no password; a user name alone is not a secret
    return f"{userinfo.partition(':')[0]}:***@{host}"


def _redact_query(text: str) -> str:
    before, question, query = text.partition("?")
    if not question:
        return text
    query, hash_, fragment = query.partition("#")
    params = "&".join(_redact_param(p) for p in query.split("&"))
    return f"{before}?{params}{hash_}{fragment}"


def _redact_param(param: str) -> str:
    name, equals, _ = param.partition("=")
    secret = any(s in unquote(name).lower() for s in _SECRET_PARAMS)
    return f"{name}=***" if equals and secret else param


#: Arguments longer than this go to the socket as they are, without being copied into one
#: packed command (redis-py's own cut-off).
_BUFFER_CUTOFF = 6000


#: Bytes read from the socket per call: a gradient or parameter vector arrives in a few
#: reads rather than one per 64 KiB, redis-py's default (each one a syscall and a feed into
#: the parser).
SOCKET_READ_SIZE = 1 << 20


class ZeroCopyPacker:
    """Packs commands for the socket without copying large arguments.

    With hiredis installed, redis-py packs every command into one new bytes object, so each
    gradient or parameter vector would be copied once more before the socket copies it
    again. Commands with a large argument (or a memoryview) go through redis-py's
    pure-Python packer, which hands such arguments to ``sendall`` as they are; all other
    commands keep hiredis' packer, which is faster for many small arguments.

    Made only where redis-py has what it uses (gemq/state/redispy.py checks).
    """

    def __init__(self) -> None:
        from redis.connection import (
            HIREDIS_AVAILABLE,
            Encoder,
            HiredisRespSerializer,
            PythonRespSerializer,
        )
        self._python = PythonRespSerializer(_BUFFER_CUTOFF,
                                            Encoder("utf-8", "strict", False).encode)
        self._hiredis = HiredisRespSerializer() if HIREDIS_AVAILABLE else self._python

    def pack(self, *args: Any) -> list[Any]:
        large = any(isinstance(a, memoryview) or (isinstance(a, bytes | bytearray)
                                                  and len(a) > _BUFFER_CUTOFF) for a in args)
        return (self._python if large else self._hiredis).pack(*args)


def _packing_settings() -> dict[str, Any]:
    """How gemq's connections send commands: large arguments without a copy where redis-py
    allows it (gemq/state/redispy.py), else as redis-py packs them."""
    return {"command_packer": ZeroCopyPacker()} if redispy.zero_copy_packing() else {}


def _reading_settings() -> dict[str, Any]:
    """How gemq's connections read replies: in chunks of SOCKET_READ_SIZE, large ones in
    place (gemq/state/bulkreads.py) where redis-py has what that needs, else with its own
    parser (gemq/state/redispy.py decides). redis-py allows its maintenance notifications
    (a Redis Enterprise feature) only with its own parsers: they stay off either way."""
    parser = redispy.in_place_parser()
    return {"socket_read_size": SOCKET_READ_SIZE, **redispy.maint_notifications_off(),
            **({"parser_class": parser} if parser is not None else {})}


def connect(url: str, *, wait_s: float | None = 30.0, socket_timeout_s: float = 30.0,
            retries: int = 3) -> redis.Redis:
    """A client for ``url`` (redis://, rediss:// or unix://, password and ACL user included).

    Waits up to ``wait_s`` for the server to answer PING, retrying with capped exponential
    backoff (one warning, then quiet retries: wait_until_ready); then raises RedisUnavailable
    naming the URL.
    ``wait_s=None`` does not wait: the client connects on its first command.
    Commands on the returned client are re-sent up to ``retries`` times after a transient
    connection error. Only idempotent callers should allow that: a worker, whose XADD must
    not land twice, passes ``retries=0`` and waits out outages in its own loop.

    A node of a Redis Cluster gets a cluster client (gemq/running/cluster.py), which speaks the
    same commands and sends each to the node serving its key's slot.
    """
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=5, socket_timeout=socket_timeout_s,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retries),
            retry_on_error=list(TRANSIENT_ERRORS), health_check_interval=30,
            connection_class=deadline.connection_class(url),
            **_packing_settings(), **_reading_settings())
    except ValueError as e:
        raise RedisUnavailable(f"invalid Redis URL {redact(url)!r}: {e}") from e
    if wait_s is not None:
        wait_until_ready(url, wait_s)
        cluster = is_cluster(client)
    else:  # asked not to wait: tell a cluster now if Redis answers at once
        try:
            cluster = is_cluster(url, timeout_s=1.0)
        except RedisUnavailable as e:
            log.warning("%s; taking it for a standalone Redis (a Redis Cluster is recognised "
                        "only when it answers at start-up)", e)
            cluster = False
    if cluster:
        client.close()
        return cast(redis.Redis, connect_cluster(
            url, wait_s=None, socket_timeout_s=socket_timeout_s, retries=retries))
    return client


#: How long a command a person waits on (``gemq run``, ``create``, ``status`` ...) gives an
#: unreachable Redis before it says so: long enough for a server that is still starting,
#: short enough that a wrong URL is one line, not half a minute of retries.
COMMAND_WAIT_S = 5.0
#: While waiting longer (services, which wait for Redis as long as it takes), a reminder
#: that they are still waiting, this often.
_REMIND_EVERY_S = 30.0


#: How long one PING of ``wait_until_ready`` may take, to connect and then to answer.
PROBE_TIMEOUT_S = 5.0


def probe_client(url: str, timeout_s: float) -> redis.Redis:
    """A client for one quick question (PING, INFO): ``timeout_s`` to connect and to
    answer, no retry."""
    return redis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                connection_class=deadline.connection_class(url))


def wait_until_ready(url: str, wait_s: float) -> None:
    """PING ``url`` until it answers, for up to ``wait_s`` seconds.

    The first failed attempt is one warning saying how long it waits; the retries after it
    are quiet (debug) but for a reminder every _REMIND_EVERY_S; the last one raises
    RedisUnavailable with the last error and what to check.
    """
    started = time.monotonic()
    deadline = started + wait_s
    delay, attempt, reminded = 0.1, 0, started
    while True:
        attempt += 1
        try:
            with probe_client(url, PROBE_TIMEOUT_S) as probe:
                probe.ping()
            if attempt > 1:
                log.info("Redis at %s answered after %.1f s", redact(url),
                         time.monotonic() - started)
            return
        except redis.AuthenticationError as e:
            raise RedisUnavailable(f"Redis at {redact(url)} refused the credentials: {e}") from e
        except _UNREACHABLE as e:
            now = time.monotonic()
            if now >= deadline:
                raise RedisUnavailable(
                    f"cannot reach Redis at {redact(url)} within {wait_s:g} s ({attempt} "
                    f"attempts): {str(e).rstrip('.')}. Check that a Redis server runs "
                    "there and that --redis-url (or GEMQ_REDIS_URL) names it") from e
            if attempt == 1:
                log.warning("Redis at %s not reachable (%s); waiting %s", redact(url), e,
                            "until it answers" if wait_s == float("inf")
                            else f"up to {wait_s:.0f} s")
            elif now - reminded >= _REMIND_EVERY_S:
                reminded = now
                log.warning("still waiting for Redis at %s (%.0f s so far): %s",
                            redact(url), now - started, e)
            else:
                log.debug("Redis at %s not reachable (%s); retrying in %.1fs",
                          redact(url), e, delay)
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 2.0)
        except redis.RedisError as e:  # a URL option redis-py refuses (ssl_cert_reqs=...)
            raise _unusable(url, e) from e


class Backoff:
    """Waiting out an outage: capped exponential delays, one log line per attempt."""

    def __init__(self, what: str, first_s: float = 0.1, cap_s: float = 5.0) -> None:
        self.what = what
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay = first_s

    def wait(self, stop: threading.Event, error: Exception) -> None:
        log.warning("%s: Redis unreachable (%s); retrying in %.1fs", self.what, error,
                    self.delay)
        stop.wait(self.delay)
        self.delay = min(self.delay * 2, self.cap_s)

    def reset(self) -> None:
        if self.delay != self.first_s:
            log.info("%s: Redis reachable again", self.what)
        self.delay = self.first_s


class BoundedOutage:
    """Waiting out an outage for at most ``bound_s`` seconds: Backoff's delays, then
    RedisUnavailable. ``over()`` when Redis answers again starts the next outage's count
    afresh."""

    def __init__(self, what: str, bound_s: float, why: str) -> None:
        self.backoff = Backoff(what)
        self.bound_s = bound_s
        self.why = why  # what the bound is, as the error states it
        self._since: float | None = None

    def wait(self, error: Exception) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since > self.bound_s:
            raise RedisUnavailable(
                f"{self.backoff.what}: Redis unreachable for {now - self._since:.0f} s, "
                f"longer than {self.why} ({self.bound_s:g} s): {error}") from error
        self.backoff.wait(threading.Event(), error)

    def over(self) -> None:
        if self._since is not None:
            self._since = None
            self.backoff.reset()


def is_cluster(client_or_url: redis.Redis | RedisCluster | str, timeout_s: float = 5.0) -> bool:
    """Whether the Redis behind a client or URL runs in cluster mode (one INFO call; for a
    URL, RedisUnavailable if it does not answer within ``timeout_s``)."""
    if isinstance(client_or_url, RedisCluster):
        return True
    if isinstance(client_or_url, redis.Redis):
        return _cluster_enabled(client_or_url)
    url = client_or_url
    try:
        with probe_client(url, timeout_s) as client:
            return _cluster_enabled(client)
    except ValueError as e:
        raise RedisUnavailable(f"invalid Redis URL {redact(url)!r}: {e}") from e
    except redis.AuthenticationError as e:
        raise RedisUnavailable(f"Redis at {redact(url)} refused the credentials: {e}") from e
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        raise RedisUnavailable(f"cannot reach Redis at {redact(url)}: {e}") from e
    except redis.RedisError as e:  # a URL option redis-py refuses (ssl_cert_reqs=...)
        raise _unusable(url, e) from e


def _unusable(url: str, error: Exception) -> GemqError:
    """What no wait will mend (a URL option redis-py refuses): not RedisUnavailable, which
    the services wait out."""
    return GemqError(f"cannot use Redis at {redact(url)}: {error}")


def _cluster_enabled(client: redis.Redis) -> bool:
    info: Any = client.info("cluster")
    return bool(int(info.get("cluster_enabled", 0)))


class _NodePool(redis.ConnectionPool):
    """The connection pool of each cluster node, with the settings ``connect`` gives a
    standalone client that RedisCluster would drop: it forwards only a fixed list of
    connection arguments to its nodes, without ``command_packer``, ``health_check_interval``
    or the parser, but it does use the pool class it is given."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("health_check_interval", 30)
        kwargs["connection_class"] = deadline.with_deadlines(
            kwargs.get("connection_class", redis.Connection))
        for name, value in {**_packing_settings(), **_reading_settings()}.items():
            kwargs.setdefault(name, value)
        super().__init__(**kwargs)


def connect_cluster(url: str, *, wait_s: float | None = 30.0, socket_timeout_s: float = 30.0,
                    retries: int = 3) -> RedisCluster:
    """A cluster client from any node's URL (redis:// or rediss://, password and ACL user
    included), with ``connect``'s settings: timeouts, read size, zero-copy packing.

    Waits up to ``wait_s`` for that node to answer PING; then discovers the cluster at
    once (RedisCluster always does), raising RedisUnavailable if it cannot, if the node is
    not in cluster mode, or if some slot is served by no node. ``retries``: how often a
    command (or a whole MULTI/EXEC) is re-sent after a connection error or a cluster
    outage, right away, after re-reading the slot map; a worker passes 0 (its XADD must
    not land twice).
    """
    if wait_s is not None:
        wait_until_ready(url, wait_s)
    try:
        return RedisCluster.from_url(
            url, socket_connect_timeout=5, socket_timeout=socket_timeout_s,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retries),
            connection_pool_class=_NodePool)
    except ValueError as e:
        raise RedisUnavailable(f"invalid Redis URL {redact(url)!r}: {e}") from e
    except (RedisClusterException, redis.RedisError) as e:
        raise RedisUnavailable(f"no Redis Cluster at {redact(url)}: {e}") from e
