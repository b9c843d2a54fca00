"""Elastic workers: one GEM run goes on while workers join and leave, as with `kubectl scale`.

    python -m benchmarks.elastic                      # 2 -> 8 -> 3 workers, docs/elastic.png
    python -m benchmarks.elastic --phase-s 10 --json elastic.json --redis-url redis://...

About 60-90 s on two cores, most of it six new workers loading torch and MNIST at once.

Real processes, as on Kubernetes: a redis-server (a private one unless --redis-url), the
aggregator service (`gemq aggregator --serve`, the aggregator pods' command) and worker
services (`gemq worker --follow`, the worker pods' command, one logical worker each). The run
is created and its aggregation job enqueued the way POST /api/runs does it. Then the workers
are scaled 2 -> 8 -> 3: new processes find the running run by themselves; removed ones get
SIGTERM, which is what Kubernetes sends a pod that `kubectl scale` removes.

A phase has settled once removed workers have exited, every worker has had WARMUP gradients
applied since the change (GEM's per-worker moment starts at zero) and the aggregator holds
state for exactly n workers. Its steady state is measured over ``phase_s`` seconds after
that, and as close to the next change as possible (its last ``phase_s`` seconds before the
next count takes effect: new workers take a while to load), so that neighbouring phases are
compared at nearly the same point of training. Reported, from the aggregator's metrics
stream and the dashboard's worker table (gemq.services.api.views):

- mean staleness. The paper's round-robin model gives n - 1. A gemq worker publishes and
  reads the parameters again at once, without waiting for its own gradient to be applied,
  so that gradient counts too when the aggregator has not applied it yet: between n - 1
  and n, plus the update rate times any time a gradient waits in the stream;
- GEM's median pi: it falls as workers are added (more drift per update to cancel) and
  rises as they leave;
- updates/s, and how many workers the aggregator and the dashboard count.

On a machine with fewer cores than processes the workers run at nice 10 (`gemq run` uses 5):
an aggregator waiting behind eight busy workers for CPU would let the stream back up, and
staleness would then measure that queue rather than the worker count. On Kubernetes the
aggregator pod has a CPU request of its own; the nice level stands in for it here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from gemq.config import RunConfig
from gemq.running.embedded import EmbeddedRedis
from gemq.running.runs import create_run
from gemq.services.api.views import ACTIVE_WINDOW_MS, worker_view
from gemq.services.jobs import enqueue_aggregation
from gemq.state.store import RunState, RunStore, now_ms

DEFAULT_SCHEDULE = (2, 8, 3)
DEFAULT_OUT = Path("docs/elastic.png")
#: Gradients applied per worker after it joined before its phase counts as settled
#: (GEM's per-worker moment builds up as 1 - mu^k: 0.9^25 is 7%).
WARMUP = 25
#: The aggregator forgets a worker silent this long (s); the default (60 s) is for real
#: clusters, where a pod may pause; here departures should show within the demo.
WORKER_TIMEOUT_S = 4.0
#: Seconds between two samples of the run's state and worker table.
POLL_S = 0.25


@dataclass(frozen=True)
class Options:
    schedule: tuple[int, ...] = DEFAULT_SCHEDULE
    #: Length (s) of the steady-state window measured in each phase.
    phase_s: float = 8.0
    #: Longest wait (s) for a phase to come a step closer to settling.
    settle_timeout_s: float = 90.0
    # The paper's CNN: a gradient costs a worker ~14 ms of one core, many times what the
    # aggregator spends applying it, as with real models. With a tiny model (mlp on digits,
    # 1 ms a gradient) two workers already outrun the aggregator on two shared cores: the
    # stream backs up and staleness then measures that queue, not the worker count.
    model: str = "cnn"
    dataset: str = "mnist5k"
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    kappa: float = 1.0
    seed: int = 0
    #: Of the worker processes; the aggregator runs at 0 (see the module docstring).
    niceness: int = 10


@dataclass
class Phase:
    workers: int
    changed_s: float
    settled_s: float = float("nan")
    #: When the phase_s of steady state after settling had been recorded.
    end_s: float = float("nan")
    #: The steady-state window the statistics below come from: the last phase_s seconds
    #: before the next change took effect (the first gradient of a joining worker, or the
    #: SIGTERM), which keeps it next to the change; for the last phase, the phase_s after
    #: it settled. So a comparison with the next phase is not confounded by how training
    #: itself moves pi.
    window_start_s: float = float("nan")
    window_end_s: float = float("nan")
    updates: int = 0
    updates_per_s: float = float("nan")
    #: Mean over the window's gradients: what the dashboard and /metrics average.
    staleness_mean: float = float("nan")
    #: The staleness of the window's typical batch (median of the batch means, weighted by
    #: their gradients): robust to a stall inside the window, after which the draining
    #: backlog reports the queue's length rather than the worker count.
    staleness_median: float = float("nan")
    median_pi: float = float("nan")
    #: Gradients waiting in the stream, averaged over the window's samples.
    queued: float = float("nan")
    aggregator_workers: float = float("nan")
    dashboard_active: int = -1


@dataclass
class Record:
    """Everything one elastic run measured; times in seconds since the run was started."""

    run_id: str
    options: dict[str, Any]
    phases: list[Phase] = field(default_factory=list)
    #: metrics rows: t_s, updates, applied, staleness_mean, median_pi, active_workers
    rows: list[dict[str, float]] = field(default_factory=list)
    #: samples: t_s, processes, dashboard_active, state, queued (gradients in the stream
    #: not yet applied: the aggregator trims what it applied at every commit)
    samples: list[dict[str, Any]] = field(default_factory=list)
    #: one per removed worker: id, exit code, seconds from SIGTERM to exit
    exits: list[dict[str, Any]] = field(default_factory=list)
    #: worker id -> started_s, first_seen_s (its hash appeared in Redis), left_s (SIGTERM;
    #: None while it runs), heartbeat_s (its last heartbeat_ms), steps (gradients it
    #: published), applied (of those, applied by the aggregator)
    workers: dict[str, dict[str, float | None]] = field(default_factory=dict)
    final_state: str = ""
    counters: dict[str, int] = field(default_factory=dict)
    #: Longest time (s) between two consecutive aggregator commits while running.
    longest_pause_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=float)


class Processes:
    """The aggregator and worker processes of the demo, each a child we can signal."""

    def __init__(self, url: str, run_id: str, queue: str, workdir: Path, niceness: int) -> None:
        self.url, self.run_id, self.queue = url, run_id, queue
        self.workdir, self.niceness = workdir, niceness
        self.aggregator: subprocess.Popen[bytes] | None = None
        self.workers: list[tuple[str, subprocess.Popen[bytes]]] = []
        #: SIGTERMed, not yet exited: (worker id, process, monotonic time of the signal)
        self.leaving: list[tuple[str, subprocess.Popen[bytes], float]] = []
        self._logs: list[Any] = []

    def _env(self, **gemq: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEMQ_")}
        env.update({f"GEMQ_{k.upper()}": v for k, v in gemq.items()})
        env["OMP_NUM_THREADS"] = "1"  # one core each, as with limits.cpu: 1 on Kubernetes
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        self._logs.append(log)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_aggregator(self) -> None:
        env = self._env(redis_url=self.url, aggregator_queue=self.queue,
                        heartbeat_file=str(self.workdir / "aggregator.heartbeat"))
        self.aggregator = self._spawn("aggregator", [sys.executable, "-m", "gemq",
                                                     "aggregator", "--serve"], env)

    def add_worker(self) -> str:
        """Start one worker service; return its worker id (gemq names it host-pid)."""
        index = len(self.workers)
        env = self._env(redis_url=self.url, workers="1", run=self.run_id, device="cpu",
                        poll_s="0.2",
                        heartbeat_file=str(self.workdir / f"worker-{index}.heartbeat"))
        argv = ["nice", "-n", str(self.niceness), sys.executable, "-m", "gemq", "worker",
                "--follow"]
        process = self._spawn(f"worker-{index}", argv, env)
        worker_id = f"{socket.gethostname()}-{process.pid}"  # nice execs: same pid
        self.workers.append((worker_id, process))
        return worker_id

    def remove_workers(self, count: int) -> None:
        """SIGTERM the ``count`` newest workers at once, as a scale-down does."""
        leaving, self.workers = self.workers[-count:], self.workers[:-count]
        for worker_id, process in leaving:
            process.send_signal(signal.SIGTERM)
            self.leaving.append((worker_id, process, time.monotonic()))

    def reap(self) -> list[dict[str, Any]]:
        """The removed workers that have exited since the last call: id, code, seconds."""
        exits, still = [], []
        for worker_id, process, signalled in self.leaving:
            if process.poll() is None:
                still.append((worker_id, process, signalled))
            else:
                exits.append({"worker_id": worker_id, "code": process.returncode,
                              "exit_s": round(time.monotonic() - signalled, 2)})
        self.leaving = still
        return exits

    def check_alive(self) -> None:
        for name, process in [("aggregator", self.aggregator), *self.workers]:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode}; see "
                                   f"{self.workdir}")

    def close(self) -> None:
        """SIGTERM whatever still runs, then SIGKILL what does not leave within 10 s."""
        everyone = [p for _, p in self.workers] + [p for _, p, _ in self.leaving]
        everyone += [self.aggregator] if self.aggregator else []
        for process in everyone:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in everyone:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self._logs:
            log.close()


class Recorder:
    """Samples the run: new metrics rows, the worker hashes and the state, every POLL_S."""

    def __init__(self, store: RunStore, record: Record, t0_ms: int) -> None:
        self.store, self.record, self.t0_ms = store, record, t0_ms
        self.last_id = "0-0"
        self.latest: dict[str, float] = {}
        self.states: dict[str, dict[str, str]] = {}

    def t(self, ms: float) -> float:
        return round((ms - self.t0_ms) / 1000, 3)

    def poll(self, procs: Processes) -> None:
        procs.check_alive()
        self.record.exits += procs.reap()
        for entry_id, row in self.store.metrics_since(self.last_id, 100_000):
            self.last_id = entry_id
            self.latest = {"t_s": self.t(int(row["t_ms"])), "updates": int(row["updates"]),
                           "applied": int(row["applied"]),
                           "staleness_mean": float(row["staleness_mean"]),
                           "median_pi": float(row["median_pi"]),
                           "active_workers": int(row["active_workers"])}
            self.record.rows.append(self.latest)
        self.states = self.store.worker_states()
        view = self.store.step_view()  # head, stream length and state in one round trip
        now = now_ms()
        table = [worker_view(w, s, now) for w, s in self.states.items()]
        self.record.samples.append({"t_s": self.t(now), "processes": len(procs.workers),
                                    "dashboard_active": sum(v["active"] for v in table),
                                    "state": view.state, "queued": view.pending})
        for worker_id, state in self.states.items():
            seen = self.record.workers.setdefault(worker_id, _worker_entry(None))
            if seen["first_seen_s"] is None:
                seen["first_seen_s"] = self.t(now)
            seen["heartbeat_s"] = self.t(int(state.get("heartbeat_ms", 0)))
            seen["applied"] = int(state.get("applied", 0))
            seen["steps"] = int(state.get("steps", 0))

    def applied(self, worker_id: str) -> int:
        return int(self.states.get(worker_id, {}).get("applied", 0))

    def dashboard_active(self) -> int:
        return int(self.record.samples[-1]["dashboard_active"]) if self.record.samples else 0


def run_elastic(url: str, options: Options = Options()) -> Record:
    """Create a run, scale its workers through ``options.schedule``, stop it; the record."""
    run_id = f"elastic-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    try:
        config = RunConfig.from_dict({
            "run_id": run_id, "model": options.model, "dataset": options.dataset,
            "batch_size": options.batch_size, "lr": options.lr, "momentum": options.momentum,
            "kappa": options.kappa, "seed": options.seed, "budget_updates": 10**9,
            "worker_timeout_s": WORKER_TIMEOUT_S})
        store = create_run(client, config)
        record = Record(run_id=run_id, options=asdict(options))
        with tempfile.TemporaryDirectory(prefix="gemq-elastic-") as workdir, \
                _processes(url, run_id, Path(workdir), options.niceness) as procs:
            procs.start_aggregator()
            enqueue_aggregation(store, client, procs.queue)
            _scale_through(store, procs, record, options)
        record.final_state = store.state()
        record.counters = store.counters()
        record.longest_pause_s = _longest_pause(record.rows)
        return record
    finally:
        client.close()


@contextlib.contextmanager
def _processes(url: str, run_id: str, workdir: Path, niceness: int) -> Iterator[Processes]:
    procs = Processes(url, run_id, f"gemq-elastic-{run_id}", workdir, niceness)
    try:
        yield procs
    finally:
        procs.close()


def _scale_through(store: RunStore, procs: Processes, record: Record,
                   options: Options) -> None:
    t0_ms = now_ms()
    recorder = Recorder(store, record, t0_ms)
    for n in options.schedule:
        phase = Phase(workers=n, changed_s=recorder.t(now_ms()))
        record.phases.append(phase)
        joined = [procs.add_worker() for _ in range(n - len(procs.workers))]
        for worker_id in joined:
            record.workers[worker_id] = _worker_entry(phase.changed_s)
        if len(procs.workers) > n:
            for worker_id, _ in procs.workers[n:]:
                record.workers[worker_id]["left_s"] = phase.changed_s
            procs.remove_workers(len(procs.workers) - n)
        baseline = {w: recorder.applied(w) for w, _ in procs.workers}
        _settle(recorder, procs, phase, baseline, options)
        _measure(recorder, procs, phase, options.phase_s)
    _place_windows(record, options.phase_s)
    for phase in record.phases:
        _summarise(phase, record)
    store.request_stop()
    _wait(lambda: store.state() != RunState.RUNNING, 30, "the run to stop")
    if store.state() != RunState.STOPPED:
        raise RuntimeError(f"run {store.run_id} ended {store.state()!r}, not stopped")


def _worker_entry(started_s: float | None) -> dict[str, float | None]:
    return {"started_s": started_s, "first_seen_s": None, "left_s": None,
            "heartbeat_s": None, "applied": 0, "steps": 0}


def _settle(recorder: Recorder, procs: Processes, phase: Phase, baseline: dict[str, int],
            options: Options) -> None:
    """Wait until removed workers have exited, every worker has WARMUP more gradients
    applied, and the aggregator holds GEM state for exactly n workers: as long as that
    takes while it gets closer (a loaded machine loads six new workers slowly), and no
    more than ``settle_timeout_s`` without a step closer."""
    deadline, progress = time.monotonic() + options.settle_timeout_s, None
    while True:
        recorder.poll(procs)
        applied = [recorder.applied(w) - baseline[w] for w, _ in procs.workers]
        warm = all(a >= WARMUP for a in applied)
        if warm and not procs.leaving and recorder.latest.get("active_workers") == phase.workers:
            phase.settled_s = recorder.t(now_ms())
            return
        now = (sum(min(a, WARMUP) for a in applied), len(procs.leaving),
               recorder.latest.get("active_workers"))
        if now != progress:
            deadline, progress = time.monotonic() + options.settle_timeout_s, now
        if time.monotonic() > deadline:
            raise RuntimeError(f"phase with {phase.workers} workers did not settle: no step "
                               f"closer in {options.settle_timeout_s}s: latest metrics "
                               f"{recorder.latest}, workers {recorder.states}")
        time.sleep(POLL_S)


def _measure(recorder: Recorder, procs: Processes, phase: Phase, phase_s: float) -> None:
    """Record ``phase_s`` of steady state; then go on until the dashboard shows n workers.

    The dashboard calls a worker gone ACTIVE_WINDOW_MS after its last heartbeat, which can
    outlast the window after workers left.
    """
    _poll_until(recorder, procs, time.monotonic() + phase_s, lambda: False)
    phase.end_s = recorder.t(now_ms())
    _poll_until(recorder, procs, time.monotonic() + ACTIVE_WINDOW_MS / 1000 + 5,
                lambda: recorder.dashboard_active() == phase.workers)
    phase.dashboard_active = recorder.dashboard_active()


def _poll_until(recorder: Recorder, procs: Processes, deadline: float,
                done: Callable[[], bool]) -> None:
    while time.monotonic() < deadline and not done():
        recorder.poll(procs)
        time.sleep(POLL_S)


def _place_windows(record: Record, phase_s: float) -> None:
    for phase, after in zip(record.phases, [*record.phases[1:], None], strict=True):
        if after is None:
            phase.window_start_s, phase.window_end_s = phase.settled_s, phase.end_s
            continue
        end = after.changed_s
        if after.workers > phase.workers:  # the count changes when a joiner's gradient lands
            end = next((r["t_s"] for r in record.rows if r["t_s"] > after.changed_s
                        and r["active_workers"] > phase.workers), end)
        phase.window_end_s = end
        phase.window_start_s = max(phase.settled_s, end - phase_s)


def _summarise(phase: Phase, record: Record) -> None:
    """Steady-state statistics of the rows committed in the phase's window."""
    start, end = phase.window_start_s, phase.window_end_s
    window = [r for r in record.rows if start <= r["t_s"] < end]
    applied = sum(r["applied"] for r in window)
    if len(window) < 2 or applied == 0:
        raise RuntimeError(f"no updates while {phase.workers} workers ran: the run stalled")
    phase.updates = int(window[-1]["updates"] - window[0]["updates"])
    phase.updates_per_s = round(phase.updates / max(window[-1]["t_s"] - window[0]["t_s"],
                                                    1e-3), 1)
    # Each row is one committed batch; weigh its means by the gradients it applied.
    phase.staleness_mean = round(sum(r["staleness_mean"] * r["applied"] for r in window)
                                 / applied, 3)
    phase.staleness_median = _weighted_median([(r["staleness_mean"], r["applied"])
                                               for r in window])
    phase.median_pi = round(sum(r["median_pi"] * r["applied"] for r in window) / applied, 4)
    counts = sorted(r["active_workers"] for r in window)
    phase.aggregator_workers = counts[len(counts) // 2]
    queued = [s["queued"] for s in record.samples if start <= s["t_s"] < end]
    phase.queued = round(sum(queued) / max(len(queued), 1), 2)


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    ordered = sorted(pairs)
    half, total = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        total += weight
        if total >= half:
            return round(value, 3)
    return float("nan")


def _longest_pause(rows: list[dict[str, float]]) -> float:
    times = [r["t_s"] for r in rows]
    return round(max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0), 3)


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


# ---- the figure ---------------------------------------------------------------------


def plot(record: Record, path: Path) -> Path:
    """Workers, staleness and median pi over time, one panel each, phases shaded."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, (ax_n, ax_s, ax_pi) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True,
                                            constrained_layout=True)
    _plot_workers(ax_n, record)
    bins = _binned(record.rows, 0.5)
    ax_s.plot(bins["t_s"], bins["staleness_mean"], color="tab:red", lw=1.4,
              label="mean staleness (0.5 s bins)")
    ax_pi.plot(bins["t_s"], bins["median_pi"], color="tab:purple", lw=1.4,
               label="GEM median pi (0.5 s bins)")
    for phase in record.phases:
        for ax in (ax_n, ax_s, ax_pi):
            ax.axvspan(phase.window_start_s, phase.window_end_s, color="0.92", zorder=0)
        ax_s.hlines(phase.workers - 1, phase.window_start_s, phase.window_end_s, colors="k",
                    linestyles="--", lw=1)
        ax_s.hlines(phase.workers, phase.window_start_s, phase.window_end_s, colors="k",
                    linestyles=":", lw=1)
        ax_s.annotate(f"{phase.staleness_mean:.1f}", (phase.window_end_s,
                                                      phase.staleness_mean),
                      textcoords="offset points", xytext=(3, 3), fontsize=8)
        ax_pi.annotate(f"{phase.median_pi:.3f}", (phase.window_end_s, phase.median_pi),
                       textcoords="offset points", xytext=(3, 3), fontsize=8)
    ax_s.plot([], [], "k--", lw=1, label="n - 1: the paper's round-robin workers")
    ax_s.plot([], [], "k:", lw=1, label="n: also the worker's own previous gradient, when it "
              "was not applied yet (steady-state windows shaded)")
    ax_s.set_ylabel("staleness (updates)")
    ax_pi.set_ylabel("median pi")
    ax_pi.set_xlabel("seconds since the run started")
    for ax in (ax_n, ax_s, ax_pi):
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    schedule = " -> ".join(str(p.workers) for p in record.phases)
    opts = record.options
    fig.suptitle(f"One GEM run while workers scale {schedule} ({opts['model']} on "
                 f"{opts['dataset']}); it never stopped: longest pause between commits "
                 f"{record.longest_pause_s:.2f} s", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_workers(ax: Any, record: Record) -> None:
    t = [s["t_s"] for s in record.samples]
    ax.step(t, [s["processes"] for s in record.samples], where="post", color="k", lw=1.5,
            label="worker processes (kubectl scale)")
    ax.step(t, [s["dashboard_active"] for s in record.samples], where="post",
            color="tab:blue", lw=1.2, ls="--", label="active in the dashboard's table")
    ax.step([r["t_s"] for r in record.rows], [r["active_workers"] for r in record.rows],
            where="post", color="tab:orange", lw=1, alpha=0.8,
            label="workers the aggregator holds GEM state for")
    ax.set_ylabel("workers")
    ax.set_ylim(0, max(s["processes"] for s in record.samples) + 1.5)


def _binned(rows: list[dict[str, float]], width_s: float) -> dict[str, list[float]]:
    """Per time bin: staleness and median pi averaged over the gradients applied in it."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        acc = sums.setdefault(int(r["t_s"] // width_s), [0.0, 0.0, 0.0])
        acc[0] += r["applied"]
        acc[1] += r["staleness_mean"] * r["applied"]
        acc[2] += r["median_pi"] * r["applied"]
    keys = sorted(k for k, acc in sums.items() if acc[0] > 0)
    return {"t_s": [(k + 0.5) * width_s for k in keys],
            "staleness_mean": [sums[k][1] / sums[k][0] for k in keys],
            "median_pi": [sums[k][2] / sums[k][0] for k in keys]}


# ---- command line -------------------------------------------------------------------


def table(record: Record) -> str:
    lines = ["workers  staleness: mean  typical  queued  median pi  updates/s  aggregator sees"
             "  dashboard active"]
    for p in record.phases:
        lines.append(f"{p.workers:7d}  {p.staleness_mean:15.2f}  {p.staleness_median:7.2f}  "
                     f"{p.queued:6.2f}  {p.median_pi:9.4f}  {p.updates_per_s:9.1f}  "
                     f"{p.aggregator_workers:15.0f}  {p.dashboard_active:16d}")
    exits = ", ".join(f"{e['code']} in {e['exit_s']:.2f}s" for e in record.exits)
    lines.append(f"removed workers exited: {exits or 'none'}")
    lines.append(f"run {record.run_id}: {record.final_state} when asked, longest pause between "
                 f"commits {record.longest_pause_s:.2f}s, counters {record.counters}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.elastic",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--schedule", default="2,8,3", help="worker counts, one per phase")
    parser.add_argument("--phase-s", type=float, default=8.0, help="steady-state seconds")
    parser.add_argument("--model", default=Options.model)
    parser.add_argument("--dataset", default=Options.dataset)
    parser.add_argument("--batch-size", type=int, default=Options.batch_size)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG")
    parser.add_argument("--json", type=Path, default=None, help="also write the record")
    args = parser.parse_args(argv)
    options = Options(schedule=tuple(int(n) for n in args.schedule.split(",")),
                      phase_s=args.phase_s, model=args.model, dataset=args.dataset,
                      batch_size=args.batch_size)
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(EmbeddedRedis()).url
        record = run_elastic(url, options)
    print(table(record))
    print(f"figure: {plot(record, args.out)}")
    if args.json:
        args.json.write_text(record.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
