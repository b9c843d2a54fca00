"""What every gemq process entry point does first: logging and graceful signals."""

from __future__ import annotations

import logging
import signal
import threading


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
