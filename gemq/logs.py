"""How every gemq process logs: one level, and lines of text or of JSON, set up in one place.

JSON lines carry ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``logger`` and
``message``, plus ``run`` and ``worker`` where the code that logs knows them (see
``log_context``), and ``exception`` with the traceback when there is one. A log collector
(Loki, Elasticsearch, Cloud Logging) then indexes them without a parsing rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s"
#: The fields a log line may carry beyond its own, from ``log_context`` or ``extra=``.
CONTEXT_FIELDS = ("run", "worker")

_context: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "gemq_log_context", default=MappingProxyType({}))


@contextlib.contextmanager
def log_context(**fields: str) -> Iterator[None]:
    """Within the block, this thread's log records carry ``fields`` (run=..., worker=...).

    A context variable: other threads keep theirs, and a thread started inside the block
    starts without it (Python gives each new thread an empty context).
    """
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class _ContextFilter(logging.Filter):
    """Copies the log context onto each record, unless the call gave the field itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"time": _utc_iso(record.created), "level": record.levelname,
                                 "logger": record.name, "message": record.getMessage()}
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = str(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)  # ASCII: safe whatever stderr's encoding


def _utc_iso(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def configure(level: str | int = logging.INFO, fmt: str = "text") -> None:
    """Send every record at ``level`` or above to stderr as ``fmt`` (text or json),
    replacing whatever was set up before. Python warnings become records too, so that a
    JSON log stays JSON."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_ContextFilter())
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level,
                        handlers=[handler], force=True)
    logging.captureWarnings(True)
