"""Helpers shared by tests: small runs on a real Redis, synthetic gradients, processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import redis

from gemq.aggregation.aggregator import Aggregator, AggregatorOptions
from gemq.config import RunConfig
from gemq.layout import ParamLayout
from gemq.state.store import RunState, RunStore
from gemq.wire import codec

SMALL_LAYOUT = ParamLayout.from_shapes([("w", (8, 4)), ("b", (4,))])


def small_run(client: redis.Redis, run_id: str = "t1", **settings: object) -> RunStore:
    """A run over SMALL_LAYOUT with zero initial parameters."""
    config = RunConfig.from_dict({"run_id": run_id, **settings})
    store = RunStore(client, run_id)
    store.create(config, SMALL_LAYOUT, np.zeros(SMALL_LAYOUT.size, np.float32))
    return store


def gradient_message(store: RunStore, worker_id: str, gradient: np.ndarray,
                     version: int | None = None, **overrides: object) -> memoryview:
    fields: dict[str, object] = {
        "run_id": store.run_id, "worker_id": worker_id,
        "param_version": store.head().version if version is None else version,
        "samples": 8, "loss": 1.0, "layout_id": SMALL_LAYOUT.layout_id, "gradient": gradient}
    fields.update(overrides)
    return codec.encode(**fields)  # type: ignore[arg-type]


def aggregated_run(client: redis.Redis, run_id: str = "t1", updates: int = 12) -> RunStore:
    """A GEM run over SMALL_LAYOUT whose aggregator (a thread here) applied ``updates``
    gradients of three workers one at a time: its metrics stream holds one entry each."""
    store = small_run(client, run_id, budget_updates=updates)
    shutdown = threading.Event()
    result: list[str] = []
    options = AggregatorOptions(lease_ms=400, idle_block_ms=20, standby_poll_s=0.05)
    thread = threading.Thread(target=lambda: result.append(Aggregator(store, options)
                                                           .run(shutdown)), daemon=True)
    thread.start()
    rng = np.random.default_rng(7)
    try:
        for i in range(updates):
            worker = f"w{i % 3}"
            gradient = rng.standard_normal(SMALL_LAYOUT.size).astype(np.float32)
            version = max(0, store.head().version - i % 3)  # some staleness
            store.publish_gradient(worker, gradient_message(store, worker, gradient, version))
            wait_for(lambda n=i + 1: store.counters().get("applied", 0) == n,
                     timeout_s=30, what=f"update {i + 1}")
        thread.join(30)
    finally:
        shutdown.set()
    assert result == [RunState.FINISHED]
    return store


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0,
             what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def _sigint_default() -> None:
    # As from a terminal. pytest started in the background of a non-interactive shell (a CI
    # runner may do that) hands its children SIGINT ignored, and Python then never turns
    # SIGINT into KeyboardInterrupt: a Ctrl-C test would see a process that rightly ignores it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class GemqProcess:
    """``python -m gemq ARGS`` as a child process; its output goes to a temporary file."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 cwd: Path | None = None, launcher: Sequence[str] = ()) -> None:
        """``launcher``: a command that runs the rest of the command line in place of
        itself (``exec``), such as ``unshare``."""
        self.log = tempfile.NamedTemporaryFile(prefix="gemq-proc-", suffix=".log")  # noqa: SIM115 (closed by stop())
        # A session of its own: stop() reaps its children too (rq's work horses).
        self.process = subprocess.Popen([*launcher, sys.executable, "-m", "gemq", *args],
                                        stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        cwd=cwd, start_new_session=True,
                                        preexec_fn=_sigint_default)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Kill the process and everything it started (its session: rq's work horses sit in
        process groups of their own), and release its log."""
        for line in session(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        self.process.wait()
        self.log.close()


def session(sid: int) -> list[str]:
    """The processes still alive in session ``sid``, as "pid command line" (GemqProcess
    starts each in a session of its own); zombies awaiting their parent are left out."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat=,args="], capture_output=True,
                         text=True, check=True).stdout
    return [line.strip() for line in out.splitlines()
            if int(line.split()[1]) == sid and not line.split()[2].startswith("Z")]


def sigkill_at(store: RunStore, targets: list[int], aggregator: GemqProcess,
               args: tuple[str, ...], timeout_s: float = 60) -> GemqProcess:
    """SIGKILL ``aggregator`` each time ``applied`` reaches a target and start a new one with
    ``args``; return the process that runs last."""
    for target in targets:
        wait_for(lambda t=target: store.counters().get("applied", 0) >= t,
                 timeout_s=timeout_s, what=f"{target} updates")
        aggregator.send_signal(signal.SIGKILL)
        aggregator.wait()
        aggregator.stop()
        aggregator = GemqProcess(*args)
    return aggregator


def assert_accounting_closes(store: RunStore, applied: int) -> None:
    """Every gradient published was applied once, rejected, or left unused."""
    counters = store.counters()
    rejected = sum(v for k, v in counters.items() if k.startswith("rejected:"))
    unused = counters.get("unused", 0) + store.unconsumed()
    assert counters["applied"] == applied == store.head().version
    assert counters["published"] == applied + rejected + unused
