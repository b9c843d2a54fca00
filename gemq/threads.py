"""Several long-running tasks of one process, one thread each, sharing one shutdown event."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def run_together(tasks: Sequence[tuple[str, Callable[[threading.Event], T]]],
                 shutdown: threading.Event) -> list[T]:
    """Run each ``(name, task)`` as ``task(shutdown)``, in this thread if there is one, in
    threads otherwise; return their results in order. The first error sets ``shutdown``,
    so the others leave too, and is raised here once all have."""
    if len(tasks) == 1:
        return [tasks[0][1](shutdown)]
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(index: int, task: Callable[[threading.Event], T]) -> None:
        try:
            results[index] = task(shutdown)
        except BaseException as e:  # stop the siblings, then re-raise in the caller
            errors.append(e)
            shutdown.set()

    threads = [threading.Thread(target=run, args=(i, task), name=name)
               for i, (name, task) in enumerate(tasks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(tasks))]
