"""gemq: asynchronous PyTorch training over Redis Streams with Gradient Energy Matching."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def train(**kwargs: Any) -> dict[str, Any]:
    """Train locally on a private Redis; see :func:`gemq.local.train`."""
    from gemq.local import train as _train  # torch is imported only by those who train

    return _train(**kwargs)
