"""The API service's retention sweep: at start-up, then every GEMQ_RETENTION_INTERVAL_S, it
frees what ended runs kept only for training and deletes the ended runs GEMQ_KEEP_RUNS and
GEMQ_KEEP_DAYS do not keep (gemq/state/retention.py). Several API replicas may sweep at once:
each deletion is claimed atomically, and one that lost the race is skipped."""

from __future__ import annotations

import asyncio
import logging

import redis
from fastapi.concurrency import run_in_threadpool

from gemq.errors import GemqError
from gemq.state.retention import RetentionPolicy, apply_retention

log = logging.getLogger(__name__)


async def sweep_forever(client: redis.Redis, policy: RetentionPolicy, interval_s: float) -> None:
    """Sweep until cancelled; a failed sweep (Redis away, say) is logged and tried again at
    the next interval."""
    while True:
        try:
            swept = await run_in_threadpool(apply_retention, client, policy)
        except (redis.RedisError, GemqError) as e:
            log.warning("retention sweep failed: %s; next try in %gs", e, interval_s)
        else:
            if swept.released or swept.deleted:
                log.info("retention: freed the training state of %d ended runs, deleted %s",
                         len(swept.released), ", ".join(swept.deleted) or "none")
        await asyncio.sleep(interval_s)
