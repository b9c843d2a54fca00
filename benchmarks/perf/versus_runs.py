"""The three contenders of benchmarks/perf/versus_ddp.py, and the one mechanism that slows or
kills a worker of each from outside.

Each runner returns the same shape: ``snapshots`` [(seconds since the clock started, updates
applied, parameters)], ``elapsed_s`` (the last snapshot's time: the budget spent, or the
last sign of life), ``updates``, ``finished`` (the budget was spent) and what the disruption
did. Every clock starts once every worker of the contender is up (process start-up, torch's
import and data loading are outside it); a restart after a kill is inside it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.perf import reference
from benchmarks.perf.common import private_redis, start, stop
from benchmarks.perf.ddp_train import SnapshotLog, read_snapshots
from benchmarks.perf.system import Recorder, counter, finish, launch
from gemq.config import RunConfig
from gemq.running.embedded import free_port
from gemq.state.store import RunState

ROOT = Path(__file__).resolve().parents[2]
UNIFORM, STRAGGLER, KILLED = "uniform", "straggler", "killed"
SITUATIONS = (UNIFORM, STRAGGLER, KILLED)
#: The straggler's duty cycle: stopped (SIGSTOP) for STOPPED_S of every PERIOD_S, running
#: (SIGCONT) the rest: a third of the CPU time it would otherwise get.
PERIOD_S, STOPPED_S = 0.3, 0.2


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have left already
        os.kill(pid, signum)


@dataclass
class Disruption:
    """What happens to one worker (the victim) of a contender, from a thread of this process:
    nothing (uniform), the straggler's duty cycle from the clock's start to the run's end,
    or SIGKILL at ``kill_at_s`` after the clock's start."""

    situation: str
    kill_at_s: float = 0.0
    killed_at_s: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def begin(self, victim: Callable[[], int | None],
              clock_start: Callable[[], float | None]) -> None:
        """``victim``: the victim's pid once known; ``clock_start``: the wall-clock time
        (time.time()) the contender's clock started, once it has."""
        if self.situation == UNIFORM:
            return
        self._thread = threading.Thread(target=self._run, args=(victim, clock_start),
                                        daemon=True)
        self._thread.start()

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, victim: Callable[[], int | None],
             clock_start: Callable[[], float | None]) -> None:
        t0 = self._wait_for(clock_start)
        pid = self._wait_for(victim)
        if t0 is None or pid is None:
            return  # the run ended before it started: nothing to disrupt
        if self.situation == STRAGGLER:
            self._duty_cycle(int(pid))
        else:
            self._kill_at(int(pid), t0)

    def _wait_for(self, read: Callable[[], Any]) -> Any:
        while not self._stop.is_set():
            value = read()
            if value is not None:
                return value
            self._stop.wait(0.01)
        return None

    def _duty_cycle(self, pid: int) -> None:
        try:
            while not self._stop.is_set():
                _signal(pid, signal.SIGSTOP)
                if self._stop.wait(STOPPED_S):
                    break
                _signal(pid, signal.SIGCONT)
                self._stop.wait(PERIOD_S - STOPPED_S)
        finally:
            _signal(pid, signal.SIGCONT)  # never leave it stopped: it must be able to exit

    def _kill_at(self, pid: int, t0: float) -> None:
        if not self._stop.wait(max(0.0, t0 + self.kill_at_s - time.time())):
            _signal(pid, signal.SIGKILL)
            self.killed_at_s = round(time.time() - t0, 3)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"situation": self.situation}
        if self.situation == KILLED:
            out["killed_at_s"] = self.killed_at_s
        return out


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):  # not there, or not written yet
        return None


def _read_pid(path: Path) -> int | None:
    value = _read_float(path)
    return None if value is None else int(value)


def _relative(rows: list[tuple[float, int, np.ndarray]],
              t0: float) -> list[tuple[float, int, np.ndarray]]:
    return [(wall - t0, step, params) for wall, step, params in rows]


# -- DDP under torchrun -------------------------------------------------------------------

def torchrun_command(n: int, situation: str, workdir: Path, batch: int,
                     steps: int) -> list[str]:
    """torchrun as a user runs it on one machine; with one elastic restart allowed where a
    worker will be lost (the group restarts and resumes from the last checkpoint)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nnodes", "1", "--nproc-per-node", str(n)]
    if situation == KILLED:
        command += ["--max-restarts", "1"]
    return command + ["-m", "benchmarks.perf.ddp_train", "--workdir", str(workdir),
                      "--steps", str(steps), "--batch-size", str(batch)]


def run_ddp(n: int, batch: int, steps: int, size: int, workdir: Path,
            disruption: Disruption, timeout_s: float) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    # torchrun's agent shares its rendezvous TCPStore with the workers by default, and a
    # restarted gloo group then reads the dead group's addresses (pytorch/pytorch#135712):
    # the restart fails with "connectFullMesh failed". This documented switch is what a
    # user finds when searching for that error.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with (workdir / "torchrun.log").open("w") as log:
        process = subprocess.Popen(torchrun_command(n, disruption.situation, workdir, batch,
                                                    steps), cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    disruption.begin(lambda: _read_pid(workdir / "pid-rank1-attempt0"),
                     lambda: _read_float(workdir / "started-attempt0"))
    try:
        returncode = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: torchrun and its ranks
        returncode = process.wait()
    finally:
        disruption.end()
    t0 = _read_float(workdir / "started-attempt0") or time.time()
    snapshots = _relative(read_snapshots(workdir / "snapshots.bin", size), t0)
    attempts = len(list(workdir.glob("started-attempt*")))
    resumed = _read_float(workdir / "started-attempt1")
    return {"snapshots": snapshots, "elapsed_s": snapshots[-1][0] if snapshots else 0.0,
            "updates": snapshots[-1][1] if snapshots else 0,
            "finished": (workdir / "done").exists(), "restarts": max(0, attempts - 1),
            # From the kill to the restarted group's first step (agent, spawn, imports,
            # rendezvous, checkpoint load): what a lost worker costs DDP besides lost steps.
            "restart_s": round(resumed - t0 - disruption.killed_at_s, 3)
            if resumed is not None and disruption.killed_at_s is not None else None,
            "torchrun_returncode": returncode, **disruption.report()}


# -- gemq ---------------------------------------------------------------------------------

def run_gemq(n: int, batch: int, budget_updates: int, disruption: Disruption,
             timeout_s: float) -> dict[str, Any]:
    """gemq with its defaults (GEM, local proxy, kappa 1, lr 0.05, momentum 0.9), one
    worker process per worker, started as benchmarks/perf/system.py starts gemq run's."""
    config = RunConfig(run_id=f"versus-ddp-{disruption.situation}-n{n}", batch_size=batch,
                       budget_updates=budget_updates)
    with private_redis() as (server, client):
        system = launch(server.url, client, config, n)
        t0_wall = time.time() - (time.monotonic() - system.started)
        disruption.begin(lambda: system.workers[1].pid, lambda: t0_wall)
        try:
            with Recorder(system.store, system.started) as recorder:
                finish(system, wait_s=timeout_s)
        finally:
            disruption.end()
        version, params = system.store.latest()
        if not recorder.snapshots or recorder.snapshots[-1][1] != version:
            recorder.snapshots.append((time.monotonic() - system.started, version,
                                       params.copy()))
        finished = system.store.state() == RunState.FINISHED
        updates = counter(system.store, "applied")
        rows = system.store.latest_metrics(10**6)
    staleness = [float(r["staleness_mean"]) for _, r in rows if int(r["applied"])]
    return {"snapshots": recorder.snapshots, "elapsed_s": recorder.snapshots[-1][0],
            "updates": updates, "finished": finished,
            "mean_staleness": round(float(np.mean(staleness)), 2) if staleness else None,
            **disruption.report()}


# -- the authors'-style parameter server --------------------------------------------------

def peer_server(config: reference.PSConfig, workdir: str) -> None:
    """benchmarks/perf/reference.py's server loop, unchanged in what it computes, writing its
    snapshots to a SnapshotLog as it goes: a server that dies or hangs when a worker is lost
    keeps the curve up to that point."""
    folder = Path(workdir)
    dist = reference._init(config, 0)
    log = SnapshotLog(folder / "snapshots.bin")
    logged_last = False

    def record(updates: int, theta: Any, done: bool) -> None:
        nonlocal logged_last
        if log.due() or (done and not logged_last):  # and the budget's last update
            log.append(updates, theta.numpy())
            logged_last = done

    (folder / "started").write_text(repr(time.time()))
    try:
        reference.serve(config, dist, record)
    except RuntimeError as e:  # a worker's connection closed: the fixed group is broken
        (folder / "crashed").write_text(f"{time.time()!r} {e}")
        os._exit(1)  # destroying a broken group can hang
    (folder / "done").write_text(repr(time.time()))
    dist.destroy_process_group()


def run_peer(n: int, batch: int, budget_updates: int, size: int, workdir: Path,
             disruption: Disruption, timeout_s: float) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    config = reference.PSConfig(n, batch, budget_updates, free_port())
    children = [start(peer_server, config, str(workdir), name="ps-server")]
    children += [start(reference.worker, config, rank, name=f"ps-worker-{rank}")
                 for rank in range(1, n + 1)]
    disruption.begin(lambda: children[1].pid, lambda: _read_float(workdir / "started"))
    try:
        children[0].join(timeout_s)
    finally:
        disruption.end()
        stop(children)
    t0 = _read_float(workdir / "started") or time.time()
    snapshots = _relative(read_snapshots(workdir / "snapshots.bin", size), t0)
    updates = snapshots[-1][1] if snapshots else 0
    # A lost worker is never told to stop: the server spends its budget with the others,
    # then waits for it forever (hung) unless its connection's loss raised (crashed).
    return {"snapshots": snapshots, "elapsed_s": snapshots[-1][0] if snapshots else 0.0,
            "updates": updates, "finished": updates >= budget_updates,
            "hung": not (workdir / "done").exists() and not (workdir / "crashed").exists(),
            "crashed": (workdir / "crashed").exists(), **disruption.report()}
