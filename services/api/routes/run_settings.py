"""The run settings a request may give, for clients that build forms (the dashboard)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gemq.config import USER_SETTINGS

from ..deps import Reader

router = APIRouter(prefix="/api", tags=["runs"])


@router.get("/settings", dependencies=[Reader])
def settings() -> dict[str, Any]:
    """Every run setting of `POST /api/runs`: type, default, range or choices, help and
    group (the dashboard builds its start form from this)."""
    return {"settings": [s.as_dict() for s in USER_SETTINGS]}
