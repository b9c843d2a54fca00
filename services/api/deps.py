"""Dependencies of the routes: the Redis client, the run store, the token checks."""

from __future__ import annotations

from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gemq.ids import is_valid_run_id
from gemq.state.store import RunStore

from ..settings import ApiSettings
from .guard import token_refusal

_bearer = HTTPBearer(auto_error=False)
#: A Redis stream id whose two parts fit Redis' unsigned 64-bit integers (19 digits do).
STREAM_ID = r"^\d{1,19}-\d{1,19}$"


def get_settings(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.settings
    return settings


def get_redis(request: Request) -> redis.Redis:
    client: redis.Redis = request.app.state.redis
    return client


def get_queue(request: Request) -> redis.Redis:
    """The client of the Redis holding the rq queue (GEMQ_QUEUE_URL, else the runs')."""
    client: redis.Redis = request.app.state.queue
    return client


def get_probe(request: Request) -> redis.Redis:
    """The readiness probe's client: a short timeout and no retries."""
    client: redis.Redis = request.app.state.probe
    return client


Settings = Annotated[ApiSettings, Depends(get_settings)]
RedisClient = Annotated[redis.Redis, Depends(get_redis)]
QueueClient = Annotated[redis.Redis, Depends(get_queue)]
ProbeClient = Annotated[redis.Redis, Depends(get_probe)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _check_token(settings: ApiSettings, request: Request) -> None:
    refusal = token_refusal(settings, request.headers.get("authorization", ""))
    if refusal is not None:
        raise refusal


def require_writer(settings: Settings, request: Request, _: Credentials) -> None:
    """Mutating endpoints: a valid token whenever one is configured.

    RequestGuard has checked it already, before the body was read; the HTTPBearer
    parameter puts the scheme in the OpenAPI document.
    """
    _check_token(settings, request)


def require_reader(settings: Settings, request: Request) -> None:
    """Reads: open unless GEMQ_OPEN_READS=false.

    The header is read by hand rather than through HTTPBearer so that the OpenAPI schema
    does not claim open reads need a token.
    """
    if not settings.open_reads:
        _check_token(settings, request)


def get_store(run_id: str, client: RedisClient) -> RunStore:
    store = RunStore(client, run_id) if is_valid_run_id(run_id) else None
    if store is None or not store.exists():
        raise HTTPException(404, f"no run {run_id!r}")
    return store


Store = Annotated[RunStore, Depends(get_store)]
#: Documented on every endpoint that needs the token.
AUTH_ERRORS: dict[int | str, dict[str, str]] = {
    401: {"description": "no bearer token (when GEMQ_API_TOKEN is set)"},
    403: {"description": "wrong bearer token, or a browser's request from another origin"}}
#: Documented on every endpoint that reads a body (RequestGuard enforces both limits).
BODY_ERRORS: dict[int | str, dict[str, str]] = {
    408: {"description": "the body did not arrive within GEMQ_BODY_TIMEOUT_S"},
    413: {"description": "the body is larger than GEMQ_MAX_BODY_BYTES"}}
Writer = Depends(require_writer)
Reader = Depends(require_reader)
