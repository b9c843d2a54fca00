"""Kubernetes probes."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ..deps import RedisClient

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Redis is not reachable"}})
def readyz(client: RedisClient) -> JSONResponse:
    """Readiness: Redis answers PING."""
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        return JSONResponse({"status": "unavailable", "detail": f"Redis: {e}"}, 503)
    return JSONResponse({"status": "ready"})
