"""gemq against PyTorch DDP (and the authors'-style parameter server) in time to a target
held-out accuracy, with uniform workers, with one straggler and with one worker killed
(issue #29). Every figure is a ratio of two times measured in the same run.

The contenders, n = 2 and 4 workers each, on the GEM paper's CNN and mnist5k, seed 0 (the
same initial parameters), b = 64 samples per worker step (gemq's default and the paper's):
- **ddp**: DistributedDataParallel under torchrun (gloo, CPU), one process per rank, global
  batch n x 64, momentum SGD with lr 0.05 and momentum 0.9 (the proxy GEM matches),
  benchmarks/perf/ddp_train.py; rank 0 checkpoints every 10 steps.
- **gemq**: GEM with its defaults, one aggregator, n worker processes on a private Redis,
  started as ``gemq run`` starts them (benchmarks/perf/system.py).
- **reference**: the parameter server built like the GEM authors' code
  (benchmarks/perf/reference.py; its server here streams its snapshots to a file).
Each spends the same budget of samples: 8 epochs of the 4,000 training samples (gemq and
the server: 8 x 4000 / 64 updates; DDP: 8 x 4000 / (64 n) steps). 8, not targets.py's 12,
so that a kill at a third of the budget lands before DDP reaches the target (it needs ~3
epochs at n = 2; with 12, the kill came after it). One torch thread per process. The
contenders run one after the other, never side by side.

The situations, the same mechanism for every contender, applied from this process to one
worker (DDP rank 1, gemq worker process 1, the server's worker 1):
1. **uniform**: nothing.
2. **straggler**: a duty cycle of SIGSTOP / SIGCONT: stopped 0.2 s of every 0.3 s from the
   clock's start to the run's end, i.e. a third of the CPU time it would get; it computes
   what it computes, only later. Identical for all three; nothing in their code knows.
3. **killed**: SIGKILL at a third of the budget's expected time: a third of the shortest
   uniform run at that n (the same wall-clock point for every contender). DDP runs under
   torchrun with ``--max-restarts 1``: the agent restarts the whole group, which resumes
   from the last checkpoint, as a DDP user's job would. gemq's and the server's workers are
   left as they are (nobody restarts the dead one).

Held-out accuracy: each contender leaves (time, updates, parameters) snapshots every
~0.2 s; they are evaluated afterwards by one judge (targets.py's: the 1,000 test samples),
so evaluating never competes with training. Time to target: the first snapshot at or
above 95% (the target of targets.py). ``ddp_over_gemq`` > 1: gemq gets there sooner.
``versus_ddp_why`` splits that ratio exactly into two factors whose product it is: the
samples DDP needed to reach the target over gemq's (< 1: gemq's asynchronous updates
learn less per sample) and gemq's samples per second up to the target over DDP's.
A full run draws accuracy against wall-clock, three contenders, one PNG per situation
(docs/versus-ddp-<situation>.png).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.perf.common import Budget, ratio
from benchmarks.perf.targets import Judge
from benchmarks.perf.versus_runs import (
    KILLED,
    ROOT,
    SITUATIONS,
    STRAGGLER,
    UNIFORM,
    Disruption,
    run_ddp,
    run_gemq,
    run_peer,
)

NAME = "versus_ddp"
WORKER_BATCH = 64
TRAIN_SAMPLES = 4000
CONTENDERS = ("ddp", "gemq", "reference")
#: The longest one contender's run may take (s); a straggler's runs take ~3x a uniform's.
RUN_TIMEOUT_S = 600.0
#: How long a contender that lost a worker gets beyond 3x its uniform time before it is
#: called stuck (the server's fixed group can hang on a dead peer).
STUCK_GRACE_S = 30.0


def updates_for(epochs: float, batch: int) -> int:
    return max(1, round(epochs * TRAIN_SAMPLES / batch))


class Versus:
    """One benchmark run: the budget, the judge, a scratch folder, and every result."""

    def __init__(self, budget: Budget, workdir: Path) -> None:
        self.epochs = budget.pick(8.0, 2.0)
        self.judge = Judge(target_accuracy=budget.pick(0.95, 0.2))
        self.size = sum(p.numel() for p in self.judge.model.parameters())
        self.workdir = workdir
        self.results: dict[str, dict[str, dict[str, Any]]] = {}

    def contend(self, n: int, situation: str, kill_at_s: float = 0.0,
                patience_s: float = RUN_TIMEOUT_S) -> dict[str, dict[str, Any]]:
        """Run the three contenders in one situation; their summaries by name."""
        folder = self.workdir / f"{situation}-n{n}"
        updates = updates_for(self.epochs, WORKER_BATCH)
        runs = {
            "ddp": run_ddp(n, WORKER_BATCH, updates_for(self.epochs, WORKER_BATCH * n),
                           self.size, folder / "ddp", Disruption(situation, kill_at_s),
                           patience_s),
            "gemq": run_gemq(n, WORKER_BATCH, updates, Disruption(situation, kill_at_s),
                             patience_s),
            "reference": run_peer(n, WORKER_BATCH, updates, self.size, folder / "reference",
                                  Disruption(situation, kill_at_s), patience_s),
        }
        for name, run in runs.items():  # a DDP step takes one minibatch on every rank
            run["samples_per_update"] = WORKER_BATCH * (n if name == "ddp" else 1)
        summaries = {name: self.summary(run) for name, run in runs.items()}
        self.results[f"{situation}_n{n}"] = summaries
        return summaries

    def summary(self, run: dict[str, Any]) -> dict[str, Any]:
        """Accuracy over time, time and updates to the target, and what the run reports."""
        curve = [(t, version, self.judge.accuracy(params))
                 for t, version, params in run.pop("snapshots")]
        reached = next(((t, v) for t, v, accuracy in curve
                        if accuracy >= self.judge.target), None)
        elapsed = run.pop("elapsed_s")
        samples = reached[1] * run.pop("samples_per_update") if reached else None
        return {"time_to_target_s": round(reached[0], 3) if reached else None,
                "updates_to_target": reached[1] if reached else None,
                "samples_to_target": samples,
                "samples_per_s_to_target": round(samples / reached[0], 1)
                if samples and reached and reached[0] > 0 else None,
                "final_accuracy": round(curve[-1][2], 4) if curve else None,
                "best_accuracy": round(max(a for _, _, a in curve), 4) if curve else None,
                "elapsed_s": round(elapsed, 3),
                "updates_per_s": round(run["updates"] / elapsed, 2) if elapsed else None,
                **run, "curve": [[round(t, 3), v, round(a, 4)] for t, v, a in curve]}


def kill_point(uniform: dict[str, dict[str, Any]]) -> float:
    """A third of the budget's expected time: of the shortest uniform run at this n."""
    return round(min(r["elapsed_s"] for r in uniform.values()) / 3, 3)


def run(budget: Budget) -> dict[str, Any]:
    ns = budget.pick((2, 4), (2,))
    situations = budget.pick(SITUATIONS, (UNIFORM,))
    load_at_start = [round(v, 2) for v in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="gemq-versus-ddp-") as tmp:
        versus = Versus(budget, Path(tmp))
        for n in ns:
            uniform = versus.contend(n, UNIFORM)
            slowest = max(r["elapsed_s"] for r in uniform.values())
            if STRAGGLER in situations:  # a third of the speed: ~3x as long, and some
                versus.contend(n, STRAGGLER, patience_s=RUN_TIMEOUT_S)
            if KILLED in situations:
                versus.contend(n, KILLED, kill_point(uniform),
                               patience_s=3 * slowest + STUCK_GRACE_S)
    result = summarise(versus.results, versus.judge.target, versus.epochs)
    result["load_average_at_start"] = load_at_start
    result["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    if not budget.quick:
        result["plots"] = draw_all(versus.results, versus.judge.target, result)
    return result


def summarise(results: dict[str, dict[str, dict[str, Any]]], target: float,
              epochs: float) -> dict[str, Any]:
    def times(name: str) -> dict[str, float | None]:
        return {key: ratio(runs[name]["time_to_target_s"], runs["gemq"]["time_to_target_s"])
                for key, runs in results.items()}

    return {
        "target": {"test_accuracy": target, "epochs_budget": epochs,
                   "worker_batch": WORKER_BATCH},
        # > 1: gemq reaches the target sooner than DDP (the server) in that situation.
        "ddp_over_gemq": times("ddp"),
        "reference_over_gemq": times("reference"),
        # The held-out accuracy each contender ended with (its last snapshot).
        "versus_ddp_accuracy": {key: {name: runs[name]["final_accuracy"] for name in runs}
                                for key, runs in results.items()},
        "versus_ddp_why": {key: why(runs) for key, runs in results.items()},
        "versus_ddp_time_to_target_s": {
            key: {name: runs[name]["time_to_target_s"] for name in runs}
            for key, runs in results.items()},
        "runs": results,
    }


def why(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """ddp_over_gemq as the product of two factors: samples to the target (DDP's over
    gemq's) and samples per second up to it (gemq's over DDP's)."""
    ddp, gemq = runs["ddp"], runs["gemq"]
    return {"samples_ddp_over_gemq": ratio(ddp["samples_to_target"],
                                           gemq["samples_to_target"]),
            "rate_gemq_over_ddp": ratio(gemq["samples_per_s_to_target"],
                                        ddp["samples_per_s_to_target"])}


def draw_all(results: dict[str, dict[str, dict[str, Any]]], target: float,
             result: dict[str, Any]) -> list[str]:
    """One PNG per situation under docs/: accuracy against wall-clock, a panel per n."""
    caption = (f"{os.cpu_count()} cores shared by every process; load average "
               f"{result['load_average_at_start']} at start, {result['load_average_at_end']} "
               f"at end; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    written = []
    for situation in SITUATIONS:
        panels = {key: runs for key, runs in results.items() if key.startswith(situation)}
        if panels:
            out = ROOT / "docs" / f"versus-ddp-{situation}.png"
            draw(situation, panels, target, caption, out)
            written.append(str(out.relative_to(ROOT)))
    return written


def draw(situation: str, panels: dict[str, dict[str, dict[str, Any]]], target: float,
         caption: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0),
                                squeeze=False)
    for ax, (key, runs) in zip(axes[0], panels.items(), strict=True):
        for name in CONTENDERS:
            curve = np.array(runs[name]["curve"]).reshape(-1, 3)
            # Steps: an accuracy holds until the next snapshot (a restart shows as a flat).
            ax.plot(curve[:, 0], curve[:, 2], label=name, lw=1.4, drawstyle="steps-post")
            if runs[name].get("killed_at_s") is not None:
                ax.axvline(runs[name]["killed_at_s"], color="grey", ls=":", lw=0.8)
        ax.axhline(target, color="black", ls="--", lw=0.8, label=f"target {target:.0%}")
        ax.set(title=f"{situation}, n = {key.rsplit('_n', 1)[1]}", xlabel="wall-clock (s)",
               ylabel="held-out accuracy", ylim=(0.5, 1.0))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
    figure.text(0.01, 0.01, caption, fontsize=7, alpha=0.7)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(out, dpi=110)
    plt.close(figure)
