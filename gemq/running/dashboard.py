"""The dashboard of a local run: ``gemq serve`` on the run's own Redis, for as long as
``gemq run --dashboard`` lives, and after the run ends until Ctrl-C (a private Redis, and
with it the run's curves, goes when ``gemq run`` exits)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from gemq.errors import GemqError
from gemq.ports import check_port_free
from gemq.process import parent_death_signal_preexec, terminate

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
#: How long the API may take to answer /healthz after it starts (imports fastapi and torch).
START_TIMEOUT_S = 120.0


class LocalDashboard:
    """A ``gemq serve`` child process on loopback; its log goes to ``log_path``."""

    def __init__(self, redis_url: str, port: int, log_path: Path) -> None:
        self.redis_url, self.port, self.log_path = redis_url, port, log_path
        self.url = f"http://{HOST}:{port}/"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalDashboard:
        check_port_free(HOST, self.port, "choose another with --dashboard PORT")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            # Its own process group: a terminal's Ctrl-C reaches gemq run, which decides
            # when the dashboard goes (after the run, on a second Ctrl-C). It dies with the
            # thread that started it, however that ends.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gemq", "serve", "--redis-url", self.redis_url,
                 "--host", HOST, "--port", str(self.port)],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                process_group=0, preexec_fn=parent_death_signal_preexec)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise GemqError(f"the dashboard did not start: {self._last_line()} "
                                f"(its log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.url + "healthz", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise GemqError(f"the dashboard did not answer within {START_TIMEOUT_S:.0f}s "
                        f"(its log: {self.log_path})")

    def _last_line(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(nothing logged)"

    def linger(self, outcome: str) -> None:
        """Keep serving until Ctrl-C (or the dashboard process ends)."""
        print(f"{outcome}; the dashboard stays at {self.url} until Ctrl-C", file=sys.stderr,
              flush=True)
        try:
            while self.process is not None and self.process.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass

    def stop(self) -> None:
        terminate(self.process, grace_s=15)
        self.process = None


@contextlib.contextmanager
def local_dashboard(redis_url: str, port: int | None,
                    log_path: Path) -> Iterator[LocalDashboard | None]:
    """The dashboard while the block runs (None when ``port`` is None)."""
    if port is None:
        yield None
        return
    dashboard = LocalDashboard(redis_url, port, log_path)
    try:
        yield dashboard.start()
    finally:
        dashboard.stop()
