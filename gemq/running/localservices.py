"""``gemq serve --local``: the service on one machine, with nothing to set up. A private
Redis, one aggregator service and one worker service run beside the API, so the
dashboard's Start button trains: the same processes a deployment runs (docs/deploy.md),
as children of this one."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator

from gemq.process import parent_death_signal_preexec, terminate
from gemq.running.embedded import EmbeddedRedis

log = logging.getLogger(__name__)

#: A worker service's threads by default: two workers share the machine's cores with the
#: aggregator and the API.
DEFAULT_WORKERS = 2
#: What each service is given to finish its current window or step on the way out.
STOP_GRACE_S = 15.0


@contextlib.contextmanager
def local_services(workers: int = DEFAULT_WORKERS) -> Iterator[str]:
    """A private Redis with an aggregator service and a worker service of ``workers``
    threads on it, for as long as the block runs; yields the Redis URL.

    The services' logs go to this process's stderr, as ``compose up`` shows them. Every
    child dies with this process, even by SIGKILL (Linux), and sits in a process group of
    its own, so that a terminal's Ctrl-C stops the API first and the services after it."""
    with EmbeddedRedis(die_with_owner=True) as server:
        log.info("started a private redis-server on port %d", server.port)
        services: list[tuple[str, subprocess.Popen[bytes]]] = []
        stopping = threading.Event()
        try:
            for command in (["aggregator", "--serve"],
                            ["worker", "--follow", "--workers", str(workers)]):
                services.append((" ".join(command[:2]), _start(command, server.url)))
            threading.Thread(target=_watch, args=(services, stopping), daemon=True,
                             name="gemq-local-services").start()
            yield server.url
        finally:
            stopping.set()
            for _, service in reversed(services):  # workers first, Redis last
                terminate(service, grace_s=STOP_GRACE_S)


def _start(command: list[str], redis_url: str) -> subprocess.Popen[bytes]:
    log.info("starting gemq %s", " ".join(command))
    return subprocess.Popen([sys.executable, "-m", "gemq", *command, "--redis-url", redis_url],
                            stdin=subprocess.DEVNULL, process_group=0,
                            preexec_fn=parent_death_signal_preexec)


def _watch(services: list[tuple[str, subprocess.Popen[bytes]]],
           stopping: threading.Event) -> None:
    """Say so when a service exits before it is asked to: runs started from the dashboard
    would wait for it."""
    running = list(services)
    while running and not stopping.wait(1.0):
        for name, service in [s for s in running if s[1].poll() is not None]:
            running.remove((name, service))
            if not stopping.is_set():
                log.error("the local service 'gemq %s' exited (code %s); runs that need it "
                          "will wait: stop with Ctrl-C and start gemq serve --local again",
                          name, service.returncode)
