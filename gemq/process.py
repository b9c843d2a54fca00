"""What every gemq process entry point does first: logging, graceful signals, allocator,
and the ties that keep a local run's processes from outliving it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from gemq import logs

#: prctl option (linux/prctl.h): the signal the kernel sends when the parent dies.
_PR_SET_PDEATHSIG = 1
#: How often (s) the fallback watchdog checks that the parent is alive.
_PARENT_POLL_S = 1.0
#: The signals that end `gemq run` like Ctrl-C: what `timeout`, a closing terminal,
#: systemd and container runtimes send.
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Allocations below this come from the heap and are reused; freed heap memory above the
#: trim threshold is kept rather than given back to the kernel.
_MMAP_THRESHOLD = 64 * 1024 * 1024
_TRIM_THRESHOLD = 256 * 1024 * 1024
_allocator_tuned = False


def keep_freed_memory() -> bool:
    """Make glibc reuse freed megabyte buffers instead of returning them to the kernel.

    The aggregator and the workers allocate and free a buffer the size of a gradient or a
    parameter vector several times per update. With glibc's defaults these come and go as
    fresh pages: every one is faulted in and zeroed by the kernel again, a large share of
    the aggregator's CPU time (docs/performance.md). Raising
    the mmap and trim thresholds keeps them in the heap; memory use stays at its peak, which
    these loops reach in their first seconds anyway. Returns False where the C library is not
    glibc (nothing is changed there).
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    _allocator_tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
                            and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _allocator_tuned


def graceful_shutdown(*, ignore_sigint: bool = False) -> threading.Event:
    """An event set by SIGTERM and SIGHUP (and SIGINT unless ignored): finish the step,
    then leave.

    A child of ``gemq run`` ignores SIGINT: Ctrl-C reaches the whole process group, and the
    parent, which owns the terminal, stops its children in order.
    """
    shutdown = threading.Event()
    for signum in TERMINATING_SIGNALS:
        signal.signal(signum, lambda *_: shutdown.set())
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, lambda *_: shutdown.set())
    return shutdown


def setup_logging(level: int = logging.INFO) -> None:
    """Text lines at ``level``: what a local run's processes log (gemq.logs)."""
    logs.configure(level)


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM or SIGHUP (see ``raise_on_termination``).

    A BaseException, like KeyboardInterrupt: every ``finally`` runs on the way out and no
    ``except Exception`` swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def raise_on_termination() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise Terminated in the main thread, so a
    process that owns children stops them (and its private Redis) as it does on Ctrl-C.

    Outside the main thread signal handlers cannot be set; the block then runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        for each in TERMINATING_SIGNALS:  # a second signal must not cut the clean-up short
            signal.signal(each, signal.SIG_IGN)
        raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in TERMINATING_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def die_with_parent(parent_pid: int | None = None, signum: int = signal.SIGKILL) -> None:
    """Have this process receive ``signum`` when its parent dies, however it died.

    Linux delivers it (prctl PR_SET_PDEATHSIG) even when the parent was SIGKILLed.
    Elsewhere a daemon thread watches the parent's pid and sends the signal itself.
    ``parent_pid``, the parent the caller expects (a forked child knows it; a child of
    multiprocessing is told its parent's), lets a parent that died before the call, while
    the child was still importing, be noticed at once. SIGKILL by default: an orphan may be
    anywhere (starting up, waiting for Redis), and dying before a commit is safe by design
    (the next leader applies the pending window once). Never raises: it may run first thing
    in a forked child, where an exception would unwind into the parent's code.
    """
    parent = parent_pid or _multiprocessing_parent() or os.getppid()
    if not _set_parent_death_signal(signum):
        threading.Thread(target=_watch_parent, args=(parent, signum), daemon=True,
                         name="gemq-parent-watch").start()
    if os.getppid() != parent:  # it died before we asked
        os.kill(os.getpid(), signum)


def _multiprocessing_parent() -> int | None:
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None


def parent_death_signal_preexec(signum: int = signal.SIGTERM) -> None:
    """For ``subprocess.Popen(preexec_fn=...)``: the child (redis-server, say) gets
    ``signum`` when the thread that started it dies. Kept across exec by Linux."""
    _set_parent_death_signal(signum)


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0)
    except (OSError, AttributeError, TypeError):
        return False


def _watch_parent(parent: int, signum: int) -> None:
    stopped = threading.Event()
    while not stopped.wait(_PARENT_POLL_S):
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)
            return


def terminate(process: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    """SIGTERM a child we started and reap it; SIGKILL if it is still there after
    ``grace_s``. Nothing to do for None or a child already gone."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
