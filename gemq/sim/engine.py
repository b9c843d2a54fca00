"""Research mode: n logical workers in one process, no Redis, deterministic.

The data path is the one of ``gemq run``, event by event. A worker reads theta (version v =
updates applied so far), computes its gradient on the next minibatch of its own stream
(``minibatches`` seeded with ``worker_seed(seed, "<run>-w<i>")``, and the very step of a real
worker, gemq.training.flatmodel.FlatModel), and its
gradient lands when the staleness model (gemq/sim/staleness.py) says so, after the updates that
landed in between; the aggregator's rule object (``make_rule``, the same code the aggregator
calls) then sees ``drift = theta_now - s`` and ``staleness = updates - v``, exactly as
``Leader._process_one`` computes them. Each worker reads theta again right after its own
commit, and gradients staler than ``max_staleness`` are rejected, as in a run.

Cost per gradient does not grow with n: a worker holds only the version it read; a version's
snapshot is shared by the workers that read it and freed when the last of them commits; the
versions older than ``max_staleness`` are dropped (their gradients would be rejected), so the
snapshots kept never exceed ``min(n, max_staleness + 1)``. The gradient is computed when it
lands, on the snapshot, so no worker holds a gradient while it waits. What does grow with n
is memory: one snapshot per in-flight version and one GEM moment per worker (4 bytes per
parameter each; 1,000 workers on the paper CNN: about 1.3 GB).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset
from tqdm import tqdm

from gemq.aggregation.rules import UpdateStats, make_rule, median_sample
from gemq.aggregation.tally import UpdateTally
from gemq.config import RunConfig
from gemq.errors import ConfigError, GemqError
from gemq.layout import ParamLayout
from gemq.sim.options import SimOptions
from gemq.sim.results import SimResult
from gemq.sim.staleness import Schedule, StalenessModel
from gemq.training.data import DataSplit, load_dataset, minibatches, worker_seed
from gemq.training.evaluate import evaluate
from gemq.training.flatmodel import FlatModel
from gemq.training.losses import load_loss
from gemq.training.models import build_model, layout_of

#: Curve points per run when ``eval_every`` is not given.
DEFAULT_POINTS = 20
#: A final loss above this share of its start means the run learned next to nothing.
STALLED = 0.9
#: Samples per evaluation batch (smaller batches suit one thread's caches).
EVAL_BATCH = 500


class Updater(Protocol):
    def apply(self, theta: np.ndarray, gradient: np.ndarray, snapshot: np.ndarray,
              worker_id: str, staleness: int) -> UpdateStats: ...

    def last_scale(self) -> np.ndarray: ...


class MomentumProxy:
    """The proxy itself: synchronous momentum SGD, m <- mu m - lr g; theta <- theta + m.

    (torch's SGD keeps b <- mu b + g and steps -lr b: the same iterates, m = -lr b.)
    """

    def __init__(self, size: int, *, lr: float, momentum: float) -> None:
        self.lr, self.momentum = lr, momentum
        self._moment = np.zeros(size, np.float32)
        self._delta = np.empty(size, np.float32)
        self._ones = np.ones(size, np.float32)

    def apply(self, theta: np.ndarray, gradient: np.ndarray, snapshot: np.ndarray,
              worker_id: str, staleness: int) -> UpdateStats:
        # Parameters; the buffers' changes follow them, added as they are: the proxy is
        # synchronous (its one worker's copy is theta), so that is each moving average's
        # exact update too (Rule.apply).
        n = self._moment.size
        self._moment *= self.momentum
        self._moment += np.multiply(gradient[:n], -self.lr, out=self._delta)
        theta[:n] += self._moment
        theta[n:] += gradient[n:]
        energy = 0.5 * float(np.dot(self._moment, self._moment))
        return UpdateStats(staleness, median_pi=1.0, e_central=energy, e_proxy=energy)

    def last_scale(self) -> np.ndarray:
        return self._ones


class InFlightSnapshots:
    """The parameter versions some simulated worker still computes on: shared between the
    workers that read the same version, reference-counted, freed when the last one commits."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: OrderedDict[int, list[Any]] = OrderedDict()  # version -> [array, readers]
        self._free: list[np.ndarray] = []  # freed arrays, reused instead of reallocated
        self.peak = 0

    def __len__(self) -> int:
        return len(self._live)

    def read(self, version: int, theta: np.ndarray) -> None:
        entry = self._live.get(version)
        if entry is None:
            array = self._free.pop() if self._free else np.empty(self.size, np.float32)
            np.copyto(array, theta)
            entry = self._live[version] = [array, 0]
            self.peak = max(self.peak, len(self._live))
        entry[1] += 1

    def get(self, version: int) -> np.ndarray | None:
        entry = self._live.get(version)
        return None if entry is None else entry[0]

    def release(self, version: int) -> None:
        entry = self._live.get(version)
        if entry is None:  # dropped as too stale
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._free.append(self._live.pop(version)[0])

    def drop_before(self, oldest: int) -> None:
        """Free every version older than ``oldest`` (versions are created in order)."""
        while self._live:
            version = next(iter(self._live))
            if version >= oldest:
                return
            self._free.append(self._live.pop(version)[0])


def _head(dataset: Dataset, count: int) -> Dataset:
    """The first ``count`` samples: a fixed evaluation subset."""
    size = len(dataset)  # type: ignore[arg-type]
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[:count] for t in dataset.tensors))
    return Subset(dataset, range(min(count, size)))


ProgressHook = Callable[[int, dict[str, float]], None]  # (updates since last call, new row)


class Simulator:
    """One simulated run: the central variable, the rule, n workers and their schedule."""

    def __init__(self, config: RunConfig, options: SimOptions,
                 data: DataSplit | None = None) -> None:
        self.config, self.options = config, options
        self.data = data or load_dataset(config.dataset)
        self.workers = 1 if options.reference else options.workers
        staleness = StalenessModel() if options.reference else options.staleness
        _check_feasible(config, staleness, self.workers)
        torch.manual_seed(config.seed)  # the initial parameters `gemq run` draws for this seed
        model = build_model(config.model, self.data.in_features, self.data.num_classes)
        self.layout: ParamLayout = layout_of(model)
        self.loss = load_loss(config.loss)
        # The step of gemq/training/worker.py (amp stays off: the simulation is deterministic).
        self.net = FlatModel(model, loss=self.loss, loss_name=config.loss)
        self.theta = self.net.values.copy()  # the central variable
        self.rule = self._updater()
        self.ids = [f"{config.run_id}-w{i}" for i in range(self.workers)]
        self.batches = [minibatches(self.data.train, config.batch_size,
                                    worker_seed(config.seed, w)) for w in self.ids]
        self.schedule = Schedule(staleness, self.workers, config.seed)
        self.versions = InFlightSnapshots(self.layout.size)
        self.read = [0] * self.workers  # the version each worker computes on
        for _ in self.ids:
            self.versions.read(0, self.theta)
        self.updates = self.gradients = self.rejected = 0
        self.window, self.total = UpdateTally(), UpdateTally()
        self.curve: list[dict[str, float]] = []
        self.pi_tensors: list[dict[str, Any]] = []
        self.eval_s = self.eval_cpu_s = 0.0
        self._in_net: int | None = None  # the version whose snapshot the net holds
        self.eval_train = _head(self.data.train, options.eval_samples)
        self.eval_test = _head(self.data.test, options.eval_samples)
        budget = config.budget_updates
        self.eval_every = options.eval_every or max(1, budget // DEFAULT_POINTS)
        self.pi_every = options.pi_every or self.eval_every

    def _updater(self) -> Updater:
        if self.options.reference and self.config.optimizer == "momentum":
            return MomentumProxy(self.layout.param_size, lr=self.config.lr,
                                 momentum=self.config.momentum)
        if self.options.reference:
            # Adam applied to each gradient as it lands, by one worker that reads theta
            # after its own commit: synchronous Adam, exactly.
            reference = self.config.replace(algo="downpour", proxy="local")
            return make_rule(reference, self.layout.param_size,
                             buffer_momenta=self.layout.buffer_momenta())
        return make_rule(self.config, self.layout.param_size,
                         dcasgd_lambda=self.options.dcasgd_lambda,
                         buffer_momenta=self.layout.buffer_momenta())

    def step(self) -> bool:
        """Land the next worker's gradient; True when it was applied, False if rejected."""
        worker = self.schedule.next()
        version = self.read[worker]
        x, y = next(self.batches[worker])  # the worker consumed this batch either way
        self.gradients += 1
        snapshot = self.versions.get(version)
        staleness = self.updates - version
        applied = snapshot is not None and staleness <= self.config.max_staleness
        if snapshot is not None and applied:
            self._apply(worker, version, snapshot, staleness, x, y)
        else:
            self.rejected += 1
        self.versions.release(version)
        self.versions.drop_before(self.updates - self.config.max_staleness)
        self.read[worker] = self.updates  # it reads theta right after its own commit
        self.versions.read(self.updates, self.theta)
        self.schedule.start(worker)
        return applied

    def _apply(self, worker: int, version: int, snapshot: np.ndarray, staleness: int,
               x: torch.Tensor, y: torch.Tensor) -> None:
        if self._in_net != version:
            self.net.load(snapshot)
            self._in_net = version
        step = self.net.gradient(x, y)  # computed on s, the copy the worker read
        stats = self.rule.apply(self.theta, step.output, snapshot, self.ids[worker], staleness)
        self.updates += 1
        mean_pi = float(self.rule.last_scale().mean())
        for tally in (self.window, self.total):
            tally.add(stats, step.loss, len(y), mean_pi, step.accuracy)

    def record(self) -> dict[str, float]:
        """Evaluate theta and close the current window: one curve point."""
        started, cpu = time.perf_counter(), time.process_time()
        self.net.load(self.theta)
        self._in_net = None
        train_loss, _ = evaluate(self.net.model, self.eval_train, EVAL_BATCH, self.loss)
        test_loss, accuracy = evaluate(self.net.model, self.eval_test, EVAL_BATCH, self.loss)
        test_accuracy = math.nan if accuracy is None else accuracy  # NaN: not a classifier
        row = {"updates": self.updates, "gradients": self.gradients,
               "worker_steps": self.gradients / self.workers,
               "epochs": self.gradients * self.config.batch_size / len(self.data.train),  # type: ignore[arg-type]
               "time": self.schedule.now, "train_loss": train_loss, "test_loss": test_loss,
               "test_accuracy": test_accuracy, **_curve_means(self.window),
               "rejected": self.rejected}
        self.curve.append(row)
        self.window = UpdateTally()
        self.eval_s += time.perf_counter() - started
        self.eval_cpu_s += time.process_time() - cpu
        return row

    def record_pi(self) -> None:
        scale, tensors = self.rule.last_scale(), self.layout.params
        self.pi_tensors.append({
            "updates": self.updates,
            "median": [median_sample(scale[t.slice]) for t in tensors],
            "mean": [float(scale[t.slice].mean()) for t in tensors],
            "zero_fraction": float(np.count_nonzero(scale == 0.0)) / scale.size,
            "clip_fraction": float(np.count_nonzero(scale >= self.config.pi_max)) / scale.size})

    def run(self, on_updates: ProgressHook | None = None) -> SimResult:
        started, cpu = time.perf_counter(), time.process_time()
        budget, reported = self.config.budget_updates, 0
        self.record()
        while self.updates < budget:
            if not self.step():
                self._check_rejections()
                continue
            if self.updates % self.pi_every == 0:
                self.record_pi()
            if self.updates % self.eval_every and self.updates < budget:
                continue
            row = self.record()
            if on_updates is not None:
                on_updates(self.updates - reported, row)
                reported = self.updates
            if not math.isfinite(row["train_loss"]):
                break  # diverged: theta is NaN or infinite from here on
        return SimResult(self.config, self.options, self.curve,
                         [t.name for t in self.layout.params], self.pi_tensors,
                         self._summary(time.perf_counter() - started,
                                       time.process_time() - cpu), self.theta)

    def _check_rejections(self) -> None:
        if self.rejected > self.config.budget_updates:
            raise GemqError(f"{self.rejected} gradients were more than max_staleness="
                            f"{self.config.max_staleness} updates stale, more than the budget "
                            f"of {self.config.budget_updates} updates; raise --max-staleness")

    def _summary(self, wall_s: float, cpu_s: float) -> dict[str, Any]:
        first, last, total = self.curve[0], self.curve[-1], _curve_means(self.total)
        final = last["train_loss"]
        # Evaluation excluded: the rates are the cost of the simulated training itself. CPU
        # time is also reported because it hardly depends on what else the machine runs.
        compute_s, compute_cpu_s = wall_s - self.eval_s, cpu_s - self.eval_cpu_s
        return {
            "algo": "proxy" if self.options.reference else self.config.algo,
            "workers": self.workers, "parameters": self.layout.param_size,
            "updates": self.updates, "gradients": self.gradients, "rejected": self.rejected,
            "initial_train_loss": first["train_loss"], "train_loss": final,
            "test_loss": last["test_loss"], "test_accuracy": last["test_accuracy"],
            "diverged": diverged(self.curve), "stalled": stalled(self.curve),
            "peak_loss_ratio": peak_ratio(self.curve),
            "staleness_mean": total["staleness_mean"], "staleness_max": total["staleness_max"],
            "energy_ratio": total["energy_ratio"], "median_pi": total["median_pi"],
            "mean_pi": total["mean_pi"], **self._pi_shares(),
            "snapshots_peak": self.versions.peak, "wall_s": wall_s, "eval_s": self.eval_s,
            "gradients_per_s": _rate(self.gradients, compute_s),
            "gradients_per_cpu_s": _rate(self.gradients, compute_cpu_s),
        }

    def _pi_shares(self) -> dict[str, float]:
        """Shares of elements with pi = 0 and pi = pi_max, averaged over the pi records."""
        rows = self.pi_tensors
        return {"pi_zero_fraction": _mean_of(rows, "zero_fraction"),
                "pi_clip_fraction": _mean_of(rows, "clip_fraction")}


def _curve_means(tally: UpdateTally) -> dict[str, float]:
    """A curve row's averages (the loss and accuracy of the minibatches are ``batch_loss``
    and ``batch_accuracy`` there)."""
    means = tally.means()
    means["batch_loss"] = means.pop("loss")
    means["batch_accuracy"] = means.pop("accuracy")
    return means


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def _mean_of(rows: list[dict[str, Any]], name: str) -> float:
    return float(np.mean([r[name] for r in rows])) if rows else math.nan


def diverged(curve: list[dict[str, float]]) -> bool:
    """NaN or infinite at any point, or a final loss above the starting one."""
    start, losses = curve[0]["train_loss"], [r["train_loss"] for r in curve]
    return not all(math.isfinite(v) for v in losses) or losses[-1] > start


def peak_ratio(curve: list[dict[str, float]]) -> float:
    """The highest loss on the way over the starting one: transient blow-ups show here."""
    start, losses = curve[0]["train_loss"], [r["train_loss"] for r in curve]
    return max(losses) / start


def stalled(curve: list[dict[str, float]]) -> bool:
    """Learned (next to) nothing: the final loss is still above STALLED of the start."""
    start, final = curve[0]["train_loss"], curve[-1]["train_loss"]
    return not math.isfinite(final) or final > STALLED * start


def _check_feasible(config: RunConfig, staleness: StalenessModel, workers: int) -> None:
    if staleness.kind == "round-robin" and workers - 1 > config.max_staleness:
        raise ConfigError("max_staleness", f"round-robin makes every update {workers - 1} "
                          f"updates stale, over max_staleness={config.max_staleness}: every "
                          f"gradient would be rejected (raise --max-staleness)")


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
    """One thread, deterministic kernels, and the caller's RNG and settings restored after."""
    threads = torch.get_num_threads()
    strict = torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(1)  # a fixed reduction order: bit-identical sums
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(strict)
            torch.set_num_threads(threads)


def simulate(config: RunConfig, options: SimOptions | None = None, *,
             data: DataSplit | None = None, on_updates: ProgressHook | None = None,
             progress: bool = False) -> SimResult:
    """Simulate one run; same config and options, same result, bit for bit."""
    options = options or SimOptions()
    bar = tqdm(total=config.budget_updates, unit="upd", dynamic_ncols=True,
               desc=f"{'proxy' if options.reference else config.algo} n={options.workers}",
               disable=not progress)

    def hook(count: int, row: dict[str, float]) -> None:
        bar.set_postfix_str(f"loss={row['train_loss']:.3f} "
                            f"staleness={row['staleness_mean']:.1f} "
                            f"median_pi={row['median_pi']:.2f}", refresh=False)
        bar.update(count)
        if on_updates is not None:
            on_updates(count, row)

    # Divergence is an outcome to measure, not an error: inf - inf is allowed to give NaN.
    with bar, deterministic_torch(), np.errstate(over="ignore", invalid="ignore"):
        return Simulator(config, options, data).run(hook)
