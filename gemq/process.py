"""What every gemq process entry point does first: logging, graceful signals, allocator."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import threading

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
    """An event set by SIGTERM (and SIGINT unless ignored): finish the step, then leave.

    A child of ``gemq run`` ignores SIGINT: Ctrl-C reaches the whole process group, and the
    parent, which owns the terminal, stops its children in order.
    """
    shutdown = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: shutdown.set())
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, lambda *_: shutdown.set())
    return shutdown


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level,
                        format="%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s")
