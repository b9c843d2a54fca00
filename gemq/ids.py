"""What a run id and a worker id may be: one pattern each, checked wherever an id comes in.

Both are used in Redis key names (gemq/state/keys.py), so neither holds a glob character,
'/', a brace or whitespace; the configuration, the wire format, the API and the aggregator
check ids against these patterns and nothing else.
"""

from __future__ import annotations

import re

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
WORKER_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def is_valid_run_id(run_id: str) -> bool:
    return bool(RUN_ID_PATTERN.fullmatch(run_id))


def is_valid_worker_id(worker_id: str) -> bool:
    return bool(WORKER_ID_PATTERN.fullmatch(worker_id))
