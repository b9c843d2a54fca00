"""Probes for Kubernetes exec checks of the aggregator and worker services.

A service touches its heartbeat file every few seconds from a daemon thread while the process
and its Python runtime are alive; ``python -m gemq.services.probe --max-age 30`` exits 0 if the
file is fresh (liveness), and ``--redis`` also checks that Redis answers (readiness).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import redis

from gemq.state.connection import probe_client

DEFAULT_HEARTBEAT_FILE = "/tmp/gemq-heartbeat"
HEARTBEAT_PERIOD_S = 5.0


def start_heartbeat(path: str, stop: threading.Event | None = None) -> threading.Thread:
    """Touch ``path`` every HEARTBEAT_PERIOD_S until the process exits or ``stop`` is set."""
    target = Path(path)

    def beat() -> None:
        while stop is None or not stop.is_set():
            target.touch()
            time.sleep(HEARTBEAT_PERIOD_S)

    thread = threading.Thread(target=beat, name="gemq-heartbeat", daemon=True)
    thread.start()
    return thread


def redis_error(url: str, timeout_s: float = 2.0) -> str | None:
    """None if Redis at ``url`` answers one PING within ``timeout_s`` (to connect, then to
    answer), else the error. One attempt: the caller decides whether to try again."""
    try:
        with probe_client(url, timeout_s) as client:
            client.ping()
    except (redis.RedisError, OSError) as e:
        return str(e) or type(e).__name__
    return None


def check(path: str, max_age_s: float, redis_url: str | None) -> str | None:
    """None when healthy, else the reason."""
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return f"no heartbeat file {path}"
    if age > max_age_s:
        return f"heartbeat {age:.0f}s old (limit {max_age_s:.0f}s)"
    error = redis_error(redis_url) if redis_url else None
    return f"Redis not reachable: {error}" if error else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemq.services.probe")
    parser.add_argument("--file", default=os.environ.get("GEMQ_HEARTBEAT_FILE",
                                                         DEFAULT_HEARTBEAT_FILE))
    parser.add_argument("--max-age", type=float, default=30.0, help="seconds")
    parser.add_argument("--redis", action="store_true", help="also PING GEMQ_REDIS_URL")
    args = parser.parse_args(argv)
    url = os.environ.get("GEMQ_REDIS_URL", "redis://127.0.0.1:6379/0") if args.redis else None
    problem = check(args.file, args.max_age, url)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
