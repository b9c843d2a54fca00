"""The API + dashboard service (FastAPI). ``gemq serve`` or ``python -m gemq.services.api``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import redis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from gemq import __version__, logs
from gemq.errors import GemqError
from gemq.ports import check_port_free
from gemq.state.connection import TRANSIENT_ERRORS, connect, redact

from ..settings import LOOPBACK, ApiSettings, load
from .guard import RequestGuard
from .routes import curves, events, health, metrics, run_settings, runs, series
from .routes.health import READY_TIMEOUT_S
from .sweeper import sweep_forever

log = logging.getLogger(__name__)
#: Socket timeout (s) of the routes' Redis commands: a command on a hung Redis fails after
#: this, is re-sent once, and the request answers 503 (about twice this in all).
REDIS_TIMEOUT_S = 2.0
#: The dashboard's files: web/ in the repository, installed as the package gemq.web.
WEB_DIR = Path(str(importlib.resources.files("gemq.web")))


def create_app(settings: ApiSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Not waiting for Redis: the service answers /healthz at once and /readyz says
        # whether Redis is there.
        app.state.redis, app.state.probe = redis_clients(settings.redis_url)
        # rq's queue: on the runs' Redis, or on the plain Redis beside a cluster.
        app.state.queue = (redis_clients(settings.queue_url)[0] if settings.queue_url
                           else app.state.redis)
        sweeper = asyncio.create_task(sweep_forever(
            app.state.redis, settings.retention(), settings.retention_interval_s))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            app.state.redis.close()
            app.state.probe.close()
            app.state.queue.close()

    app = FastAPI(title="gemq", version=__version__, lifespan=lifespan,
                  description="Start, stop and watch asynchronous GEM training runs.")
    app.state.settings = settings
    for module in (health, metrics, runs, series, curves, run_settings, events):
        app.include_router(module.router)
    for error in TRANSIENT_ERRORS:
        app.add_exception_handler(error, _redis_unavailable)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    _mount_dashboard(app)
    app.add_middleware(RequestGuard, settings=settings)
    return app


def redis_clients(url: str) -> tuple[redis.Redis, redis.Redis]:
    """The routes' client and the readiness probe's. Both time out soon, so a hung Redis
    (frozen, or a network that drops packets) is a 503 within seconds, not a request
    blocked for minutes: the routes' client re-sends a command once (a pooled connection
    may have died while Redis restarted), the probe's never."""
    return (connect(url, wait_s=None, socket_timeout_s=REDIS_TIMEOUT_S, retries=1),
            connect(url, wait_s=None, socket_timeout_s=READY_TIMEOUT_S, retries=0))


async def _redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": f"Redis is not reachable: {exc}"}, status_code=503)


#: Problems one 422 lists at most.
MAX_PROBLEMS = 20


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """A 422 that names each problem's place, message and type, and never echoes the input:
    FastAPI's own reply repeats every bad value, so a NaN in the body made the reply itself
    fail (a 500: NaN is not JSON), and a large bad body came back several times its size."""
    assert isinstance(exc, RequestValidationError)
    problems = [{"loc": [_brief(part) for part in e.get("loc", ())],
                 "msg": _brief(str(e.get("msg", ""))), "type": str(e.get("type", ""))}
                for e in exc.errors()[:MAX_PROBLEMS]]
    return JSONResponse({"detail": problems}, status_code=422)


def _brief(part: object, limit: int = 200) -> object:
    """A place or message as sent back: an unknown key can be as long as the body."""
    if isinstance(part, str) and len(part) > limit:
        return part[:limit] + "..."
    return part


def _mount_dashboard(app: FastAPI) -> None:
    if not (WEB_DIR / "index.html").exists():
        log.warning("no dashboard: %s/index.html is missing", WEB_DIR)
        return
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")


def check_binding(settings: ApiSettings) -> None:
    """Without a token, refuse to listen beyond this machine."""
    if settings.api_token is None and settings.host not in LOOPBACK:
        raise GemqError(f"refusing to listen on {settings.host} without GEMQ_API_TOKEN: set a "
                        "token, or keep the default host 127.0.0.1")


def serve(settings: ApiSettings) -> None:
    logs.configure(settings.log_level, settings.log_format)
    check_binding(settings)
    check_port_free(settings.host, settings.port,
                    "another gemq serve? choose a port with --port or GEMQ_PORT")
    # A malformed Redis URL is one clear error here, not a traceback from uvicorn's start-up.
    for url in filter(None, (settings.redis_url, settings.queue_url)):
        for client in redis_clients(url):
            client.close()
    if settings.api_token is None:
        log.warning("no GEMQ_API_TOKEN: listening on loopback only, mutations unauthenticated")
    log.info("API and dashboard on http://%s:%d (Redis %s)", settings.host, settings.port,
             redact(settings.redis_url))
    # log_config=None: uvicorn's records go through the handler set up above, at its level
    # and in its format, instead of uvicorn's own.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_config=None, access_log=False)


def main() -> None:
    serve(load(ApiSettings))


if __name__ == "__main__":
    main()
