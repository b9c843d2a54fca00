"""What every request must pass before a route sees it: a Host this service answers to, a
browser's Origin that is this service, the bearer token where one is needed, and a body of
bounded size that arrives in bounded time.

This is ASGI middleware, ahead of FastAPI, because FastAPI reads and parses a request's body
before it resolves the dependencies that check the token: refused here, a request costs
nothing, however large its body. The routes' own token dependencies (deps.py) stay for the
OpenAPI document and check the same thing again.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

import anyio
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..settings import ApiSettings

#: Methods that change nothing: no Origin check, and open while GEMQ_OPEN_READS is true.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: A refusal that may leave the body unread closes the connection: uvicorn would otherwise
#: read and discard the rest of it, for as long as the client cares to send.
CLOSE = {"Connection": "close"}


def token_refusal(settings: ApiSettings, authorization: str) -> HTTPException | None:
    """Why a request with this Authorization header may not pass; None if it may."""
    if settings.api_token is None:
        return None  # no token configured: the service listens on loopback only
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return HTTPException(401, "this endpoint needs 'Authorization: Bearer <token>'",
                             headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode(), settings.api_token.encode()):
        return HTTPException(403, "the bearer token is not valid")
    return None


def needs_token(settings: ApiSettings, method: str, path: str) -> bool:
    """Mutations under /api always (when a token is set); reads when GEMQ_OPEN_READS=false."""
    if path != "/api" and not path.startswith("/api/"):
        return False
    return method not in SAFE_METHODS or not settings.open_reads


def hostname(host_header: str) -> str:
    """The name in a Host header, without port, brackets or a trailing dot, lower-cased."""
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 literal: [::1]:8000
        return host[1:].partition("]")[0]
    return host.partition(":")[0].rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class HostRule:
    """Which Host names the service answers to: its defence against DNS rebinding, where a
    page from evil.example re-points that name at this machine and reads the service as if
    it were its own origin (the browser then sends ``Host: evil.example``)."""

    def __init__(self, settings: ApiSettings) -> None:
        self.allowed = settings.allowed_host_names()
        self.token_set = settings.api_token is not None

    def known(self, host_header: str | None) -> bool:
        if not host_header:
            return True  # browsers always send Host: a request without one is no rebinding
        name = hostname(host_header)
        address = _ip(name)
        if name == "localhost" or name in self.allowed or (address and address.is_loopback):
            return True
        if not self.token_set:
            return False  # loopback mode: only this machine's own names
        # With a token every mutation needs it, whatever the Host, so the check only guards
        # open reads; behind an ingress the service cannot know its public names, so any
        # name passes until GEMQ_ALLOWED_HOSTS lists them. IP literals pass even then:
        # kubelet probes and Prometheus address the pod by IP, and a browser sends an IP as
        # Host only for a page loaded from that very address, which is no rebinding.
        return not self.allowed or address is not None


def same_origin(origin: str | None, host_header: str | None) -> bool:
    """Whether a browser's Origin header names this service. Browsers send Origin with every
    POST, so a request without one comes from a script or curl, not from another site."""
    if origin is None:
        return True
    try:
        netloc = urlsplit(origin).netloc  # "null" (a sandboxed or file: page) has none
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == (host_header or "").strip().lower()


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"the request body is over the limit of {limit} bytes "
                              "(GEMQ_MAX_BODY_BYTES)", headers=CLOSE)


def _too_slow(timeout_s: float) -> HTTPException:
    return HTTPException(408, f"the request body did not arrive in full within {timeout_s:g} s "
                              "(GEMQ_BODY_TIMEOUT_S)", headers=CLOSE)


class BoundedBody:
    """A request's receive channel, cut off past ``limit`` bytes or ``timeout_s`` seconds.

    Only the body is timed and counted: once it is complete, receive passes straight through
    (a streaming response waits on it for the client's disconnect, as long as it streams).
    The refusals are HTTPExceptions: raised while FastAPI reads the body, they become
    responses like any other (FastAPI passes HTTPExceptions from a body read through).
    """

    def __init__(self, receive: Receive, limit: int, timeout_s: float) -> None:
        self._receive = receive
        self.limit = limit
        self.timeout_s = timeout_s
        self.deadline = anyio.current_time() + timeout_s
        self.size = 0
        self.done = False

    async def receive(self) -> Message:
        if self.done:
            return await self._receive()
        try:
            with anyio.fail_after(max(self.deadline - anyio.current_time(), 0.0)):
                message = await self._receive()
        except TimeoutError as e:
            raise _too_slow(self.timeout_s) from e
        if message["type"] != "http.request":
            self.done = True  # a disconnect
            return message
        self.size += len(message.get("body", b""))
        if self.size > self.limit:
            raise _too_large(self.limit)
        self.done = not message.get("more_body", False)
        return message


class RequestGuard:
    """ASGI middleware: refuses what may not pass before the body is read, bounds the rest."""

    def __init__(self, app: ASGIApp, settings: ApiSettings) -> None:
        self.app = app
        self.settings = settings
        self.hosts = HostRule(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope["method"], scope["path"], Headers(scope=scope))
        if refusal is not None:
            headers = {**(refusal.headers or {}), **CLOSE}
            response = JSONResponse({"detail": refusal.detail}, refusal.status_code, headers)
            await response(scope, receive, send)
            return
        body = BoundedBody(receive, self.settings.max_body_bytes, self.settings.body_timeout_s)
        await self.app(scope, body.receive, send)

    def refusal(self, method: str, path: str, headers: Headers) -> HTTPException | None:
        """The first check this request fails, in the order: Host, Origin, token, size."""
        host = headers.get("host")
        if not self.hosts.known(host):
            return HTTPException(400, f"this service does not answer to the Host {host!r}: "
                                      "only to loopback names and those in GEMQ_ALLOWED_HOSTS")
        origin = headers.get("origin")
        if method not in SAFE_METHODS and not same_origin(origin, host):
            return HTTPException(403, f"cross-origin request refused: the Origin {origin!r} "
                                      "is not this service")
        if needs_token(self.settings, method, path):
            refusal = token_refusal(self.settings, headers.get("authorization", ""))
            if refusal is not None:
                return refusal
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            return _too_large(self.settings.max_body_bytes)
        return None
