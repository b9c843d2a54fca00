"""Dependencies of the routes: the Redis client, the run store, the token checks."""

from __future__ import annotations

import hmac
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gemq.keys import is_valid_run_id
from gemq.store import RunStore

from ..settings import ApiSettings

_bearer = HTTPBearer(auto_error=False)
#: A Redis stream id whose two parts fit Redis' unsigned 64-bit integers (19 digits do).
STREAM_ID = r"^\d{1,19}-\d{1,19}$"


def get_settings(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.settings
    return settings


def get_redis(request: Request) -> redis.Redis:
    client: redis.Redis = request.app.state.redis
    return client


Settings = Annotated[ApiSettings, Depends(get_settings)]
RedisClient = Annotated[redis.Redis, Depends(get_redis)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _check_token(settings: ApiSettings, credentials: HTTPAuthorizationCredentials | None) -> None:
    if settings.api_token is None:
        return  # no token configured: the service listens on loopback only
    if credentials is None:
        raise HTTPException(401, "this endpoint needs 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), settings.api_token.encode()):
        raise HTTPException(403, "the bearer token is not valid")


def require_writer(settings: Settings, credentials: Credentials) -> None:
    """Mutating endpoints: a valid token whenever one is configured."""
    _check_token(settings, credentials)


def require_reader(settings: Settings, request: Request) -> None:
    """Reads: open unless GEMQ_OPEN_READS=false.

    The header is read by hand rather than through HTTPBearer so that the OpenAPI schema
    does not claim open reads need a token.
    """
    if settings.open_reads:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    credentials = (HTTPAuthorizationCredentials(scheme=scheme, credentials=token)
                   if scheme.lower() == "bearer" and token else None)
    _check_token(settings, credentials)


def get_store(run_id: str, client: RedisClient) -> RunStore:
    store = RunStore(client, run_id) if is_valid_run_id(run_id) else None
    if store is None or not store.exists():
        raise HTTPException(404, f"no run {run_id!r}")
    return store


Store = Annotated[RunStore, Depends(get_store)]
#: Documented on every endpoint that needs the token.
AUTH_ERRORS: dict[int | str, dict[str, str]] = {
    401: {"description": "no bearer token (when GEMQ_API_TOKEN is set)"},
    403: {"description": "wrong bearer token"}}
Writer = Depends(require_writer)
Reader = Depends(require_reader)
