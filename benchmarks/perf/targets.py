"""Wall-clock time to a target accuracy: GEM with B = 256 split as b = B/n, against
single-process momentum SGD at batch B (one torch thread, as each worker has) and the
reference parameter server (the peer), as in the GEM paper's figure 4.

Every contender runs a fixed budget of epochs and leaves (time since its start, parameters)
snapshots every ~0.2 s; they are evaluated afterwards, by the same code, so evaluation
never competes with training for the two cores. The time to target is the time of the
first snapshot whose test accuracy on the 1,000 held-out samples reaches the target.
float16 and bfloat16 wire payloads are run once each at the largest n, same budget, for
accuracy and rate.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.perf.common import SPAWN, Budget, private_redis, ratio
from benchmarks.perf.reference import run_reference
from benchmarks.perf.system import Recorder, counter, finish, launch
from gemq.config import RunConfig

NAME = "time_to_target"
EFFECTIVE_BATCH = 256
TRAIN_SAMPLES = 4000  # mnist5k's training split
WIRE_VARIANTS = {"fp16": "float16", "bf16": "bfloat16"}


def updates_for(epochs: float, batch: int) -> int:
    return max(1, round(epochs * TRAIN_SAMPLES / batch))


def sgd_process(batch: int, epochs: float, threads: int, out: str) -> None:
    """Single-process momentum SGD, the same initial parameters as a gemq run (seed 0)."""
    import torch

    from gemq.training.data import load_dataset, minibatches, worker_seed
    from gemq.training.flatmodel import flat_state
    from gemq.training.models import build_model

    if threads:  # 0: torch's default, every core
        torch.set_num_threads(threads)
    data = load_dataset("mnist5k")
    torch.manual_seed(0)
    model = build_model("cnn", data.in_features, data.num_classes).train()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = minibatches(data.train, batch, worker_seed(0, "sgd"))
    snapshots, steps = [], updates_for(epochs, batch)
    t0 = last = time.monotonic()
    for step in range(1, steps + 1):
        x, y = next(batches)
        optimiser.zero_grad(set_to_none=True)
        torch.nn.functional.nll_loss(model(x), y).backward()
        optimiser.step()
        if time.monotonic() - last >= 0.2 or step == steps:
            last = time.monotonic()
            snapshots.append((last - t0, step, flat_state(model).copy()))
    np.savez(out, times=[s[0] for s in snapshots], versions=[s[1] for s in snapshots],
             params=np.stack([s[2] for s in snapshots]), elapsed=time.monotonic() - t0,
             updates=steps)


def run_sgd(threads: int, epochs: float, workdir: Path) -> dict[str, Any]:
    out = workdir / f"sgd-{threads}.npz"
    process = SPAWN.Process(target=sgd_process, args=(EFFECTIVE_BATCH, epochs, threads,
                                                      str(out)))
    process.start()
    process.join(1800)
    with np.load(out) as saved:
        snapshots = list(zip(saved["times"].tolist(), saved["versions"].tolist(),
                             list(saved["params"]), strict=True))
        return {"snapshots": snapshots, "elapsed_s": float(saved["elapsed"]),
                "updates": int(saved["updates"])}


def run_gem(n: int, epochs: float, wire_dtype: str = "float32") -> dict[str, Any]:
    batch = EFFECTIVE_BATCH // n
    config = RunConfig(run_id=f"bench-ttt-n{n}-{wire_dtype}", batch_size=batch,
                       budget_updates=updates_for(epochs, batch), wire_dtype=wire_dtype)
    with private_redis() as (server, client):
        system = launch(server.url, client, config, n)
        with Recorder(system.store, system.started) as recorder:
            finish(system, wait_s=1800)
        elapsed = time.monotonic() - system.started
        version, params = system.store.latest()
        recorder.snapshots.append((elapsed, version, params.copy()))
        updates = counter(system.store, "applied")
        rows = system.store.latest_metrics(10**6)
    staleness = [float(r["staleness_mean"]) for _, r in rows if int(r["applied"])]
    return {"snapshots": recorder.snapshots, "elapsed_s": elapsed, "updates": updates,
            "mean_staleness": round(float(np.mean(staleness)), 2) if staleness else None}


class Judge:
    """Evaluates snapshots with one model and the held-out split, the same for everyone."""

    def __init__(self, target_accuracy: float) -> None:
        from gemq.training.data import load_dataset
        from gemq.training.models import build_model

        self.target = target_accuracy
        self.data = load_dataset("mnist5k")
        self.model = build_model("cnn", self.data.in_features, self.data.num_classes)

    def accuracy(self, params: np.ndarray) -> float:
        from gemq.training.evaluate import evaluate
        from gemq.training.flatmodel import load_flat

        load_flat(self.model, params)
        return evaluate(self.model, self.data.test)[1]

    def summary(self, run: dict[str, Any]) -> dict[str, Any]:
        """Time to target, final accuracy and update rate of one contender's run."""
        reached = None
        for t, version, params in run["snapshots"]:
            if self.accuracy(params) >= self.target:
                reached = (t, version)
                break
        final = self.accuracy(run["snapshots"][-1][2])
        out = {"time_to_target_s": round(reached[0], 3) if reached else None,
               "updates_to_target": reached[1] if reached else None,
               "final_test_accuracy": round(final, 4), "elapsed_s": round(run["elapsed_s"], 3),
               "updates": run["updates"],
               "updates_per_s": round(run["updates"] / run["elapsed_s"], 2)}
        if "mean_staleness" in run:
            out["mean_staleness"] = run["mean_staleness"]
        return out


def run(budget: Budget) -> dict[str, Any]:
    ns = budget.pick((1, 2, 4, 8), (2,))
    epochs = budget.pick(12.0, 2.0)
    judge = Judge(target_accuracy=budget.pick(0.95, 0.2))
    with tempfile.TemporaryDirectory(prefix="gemq-bench-") as tmp:
        runs: dict[str, dict[str, Any]] = {"sgd_1_thread": judge.summary(
            run_sgd(1, epochs, Path(tmp)))}
        for n in ns:
            runs[f"gem_n{n}"] = judge.summary(run_gem(n, epochs))
            runs[f"reference_n{n}"] = judge.summary(run_reference(
                n, EFFECTIVE_BATCH // n, updates_for(epochs, EFFECTIVE_BATCH // n), Path(tmp)))
        for short, dtype in WIRE_VARIANTS.items():
            runs[f"gem_n{ns[-1]}_{short}"] = judge.summary(run_gem(ns[-1], epochs, dtype))
    return summarise(runs, ns, judge.target, epochs)


def summarise(runs: dict[str, dict[str, Any]], ns: tuple[int, ...], target: float,
              epochs: float) -> dict[str, Any]:
    def t(name: str) -> float | None:
        return runs[name]["time_to_target_s"] if name in runs else None

    def rate(name: str) -> float | None:
        return runs[name]["updates_per_s"] if name in runs else None

    big = f"gem_n{ns[-1]}"
    return {
        "target": {"test_accuracy": target, "epochs_budget": epochs,
                   "effective_batch": EFFECTIVE_BATCH},
        # > 1: GEM with n workers reaches the target sooner than the single process.
        "speedup_over_sgd": {f"n{n}": ratio(t("sgd_1_thread"), t(f"gem_n{n}")) for n in ns},
        "speedup_over_reference": {f"n{n}": ratio(t(f"reference_n{n}"), t(f"gem_n{n}"))
                                   for n in ns},
        "update_rate_over_reference": {f"n{n}": ratio(rate(f"gem_n{n}"),
                                                      rate(f"reference_n{n}")) for n in ns},
        **{f"wire_{short}": {f"n{ns[-1]}": {
            f"update_rate_{short}_over_fp32": ratio(rate(f"{big}_{short}"), rate(big)),
            f"speedup_{short}_over_fp32": ratio(t(big), t(f"{big}_{short}")),
            f"final_accuracy_{short}_minus_fp32": round(
                runs[f"{big}_{short}"]["final_test_accuracy"]
                - runs[big]["final_test_accuracy"], 4)}} for short in WIRE_VARIANTS},
        "runs": runs,
    }
