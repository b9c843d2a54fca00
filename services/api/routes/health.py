"""Kubernetes probes."""

from __future__ import annotations

import asyncio

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ..deps import ProbeClient

router = APIRouter(tags=["health"])
#: Readiness answers within this many seconds whatever Redis does (a Kubernetes probe's
#: timeoutSeconds is 1 by default); the probe's client times out after as long.
READY_TIMEOUT_S = 1.0


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Redis is not reachable"}})
async def readyz(client: ProbeClient) -> JSONResponse:
    """Readiness: Redis answers PING within a second."""
    try:
        # A thread of its own, abandoned on time-out: the answer never waits on a hung
        # Redis, not even for a new connection (connect() allows those 5 s).
        await asyncio.wait_for(asyncio.to_thread(client.ping), READY_TIMEOUT_S)
    except TimeoutError:
        return _unavailable(f"Redis did not answer PING within {READY_TIMEOUT_S:g} s")
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        return _unavailable(f"Redis: {e}")
    return JSONResponse({"status": "ready"})


def _unavailable(detail: str) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "detail": detail}, 503)
