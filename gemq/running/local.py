"""All-in-one local training: Redis, one aggregator and n worker processes on this machine.

``train()`` is what ``gemq run`` calls; from Python::

    summary = gemq.train("cnn", "mnist5k", workers=4, epochs=10)   # a gemq.RunSummary
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import redis
import torch
from torch import nn

from gemq.aggregation.aggregator import aggregator_main
from gemq.aggregation.snapshots import budget_advice
from gemq.config import (
    BUDGET,
    USER_SETTINGS,
    RunConfig,
    left_to_gemq,
    make_config,
    short_budget_note,
    validate_settings,
)
from gemq.configfile import write_config_file
from gemq.errors import ConfigError, GemqError, RunExists
from gemq.process import raise_on_termination
from gemq.records.curves import CURVES_FILE
from gemq.records.progress import ProgressDisplay
from gemq.records.recording import CurveRecorder
from gemq.records.runfolder import RunFolder
from gemq.records.summary import RunSummary, run_totals
from gemq.records.tensorboard_curves import require_tensorboard
from gemq.records.verdict import poor_result
from gemq.running.cluster import EmbeddedCluster
from gemq.running.dashboard import local_dashboard
from gemq.running.modelfile import MODEL_FILE, ModelFile
from gemq.running.runs import create_sized, initial_state
from gemq.running.savedstate import SavedState, state_file
from gemq.running.sizing import Room, Sizing
from gemq.state.connection import (
    COMMAND_WAIT_S,
    TRANSIENT_ERRORS,
    BoundedOutage,
    connect,
    is_cluster,
    redact,
    wait_until_ready,
)
from gemq.state.retention import release_if_ended
from gemq.state.serverfit import BULK_LEN_SLACK, largest_value, memory_figures
from gemq.state.store import ENDED, RunState, RunStore, now_ms
from gemq.training.data import DataSplit, load_dataset
from gemq.training.evaluate import evaluate, frequency_loss, majority_share
from gemq.training.losses import load_loss
from gemq.training.models import build_model
from gemq.training.specs import spec_of
from gemq.training.worker import resolve_device, worker_main

log = logging.getLogger(__name__)

#: Redis' smallest allowed proto-max-bulk-len.
MIN_BULK_LEN = 1024 * 1024
#: The most masters --local-cluster starts (each is a redis-server process).
MAX_LOCAL_MASTERS = 16
#: Worker processes yield the CPU to the aggregator and Redis: on a machine with fewer cores
#: than processes, a starved aggregator lets the stream back up and staleness grow.
LOCAL_WORKER_NICENESS = 5

ModelSpec = str | Callable[[], torch.nn.Module]
DatasetSpec = str | Callable[[], Any]
DEFAULT_MODEL: str = next(s.default for s in USER_SETTINGS if s.name == "model")
DEFAULT_DATASET: str = next(s.default for s in USER_SETTINGS if s.name == "dataset")


@dataclass(frozen=True)
class LocalOptions:
    workers: int = 4
    #: Worker processes; the logical workers are spread over them as threads. 0: as many
    #: as workers, up to max(4, CPU count).
    worker_processes: int = 0
    redis_url: str | None = None
    out_dir: Path | None = None
    progress: bool = True
    device: str = "cpu"
    lease_ms: int = 5000
    #: Masters of a private Redis Cluster to start instead of one private Redis (0: none).
    local_cluster: int = 0
    #: Also write the curves as TensorBoard scalars, under <tensorboard>/<run id>.
    tensorboard: Path | None = None
    #: Serve the dashboard for the run on this loopback port (None: no dashboard).
    dashboard: int | None = None


def train(model: ModelSpec = DEFAULT_MODEL, dataset: DatasetSpec = DEFAULT_DATASET, *,
          workers: int = 4, epochs: float | None = None, steps: int | None = None,
          algo: str | None = None, proxy: str | None = None,
          optimizer: str | None = None, lr: float | str | None = None,
          momentum: float | None = None, beta2: float | None = None,
          kappa: float | None = None,
          pi_max: float | None = None, batch_size: int | None = None,
          seed: int | None = None, eval_every: int | None = None,
          max_staleness: int | None = None,
          snapshot_budget_mb: int | None = None, max_pending: int | None = None,
          shards: int | None = None, wire_dtype: str | None = None,
          publish_every: int | None = None, publish_interval_ms: int | None = None,
          max_rejected_in_a_row: int | None = None, stall_timeout_s: float | None = None,
          loss: str | None = None, amp: str | None = None,
          checkpoint_overhead: float | None = None, init_from: str | Path | None = None,
          run_id: str | None = None, redis_url: str | None = None,
          out_dir: str | Path | None = None, progress: bool = True, device: str = "cpu",
          worker_processes: int = 0, local_cluster: int = 0,
          tensorboard: str | Path | None = None, dashboard: int | None = None) -> RunSummary:
    """Train locally on a private Redis (or ``redis_url``); return the run summary, which is
    also written to ``out_dir`` (default ``runs/<run id>``) with the model and the curves
    (metrics.csv; and TensorBoard scalars under ``tensorboard``/<run id> if given).

    ``model`` and ``dataset`` are built-in names, ``module:factory`` specs, or importable
    callables. The budget is ``epochs`` (passes over the training set, summed over workers)
    or ``steps`` (updates). ``init_from``: a state_dict file (an earlier run's model.pt) to
    start from. ``local_cluster``: start a private Redis Cluster of that many masters
    (instead of one private Redis) to try the sharded topology. ``dashboard``: serve the
    dashboard on that loopback port while the run trains, and after it until Ctrl-C (the
    run's curves live in its private Redis). Every setting left None takes RunConfig's
    default (see ``gemq run --help``, or gemq.config, for each one's meaning, default and
    range), except the five gemq chooses for the model, the workers and the machine
    (shards, max_pending, snapshot_budget_mb, wire_dtype, publish_every: None or "auto";
    gemq.running.sizing) and the learning rate, the optimizer's (0.05 for momentum, 0.001
    for adam) when None or "auto".
    """
    given = locals()  # the arguments, by name: one per user setting (a test checks)
    settings: dict[str, Any] = {s.name: given[s.name] for s in USER_SETTINGS}
    settings.update(model=_spec(model), dataset=_spec(dataset), run_id=run_id)
    validate_settings(settings)  # every setting, before the dataset is loaded
    options = LocalOptions(workers=workers, worker_processes=worker_processes,
                           redis_url=redis_url, out_dir=Path(out_dir) if out_dir else None,
                           progress=progress, device=device, local_cluster=local_cluster,
                           tensorboard=Path(tensorboard) if tensorboard else None,
                           dashboard=dashboard)
    check_options(options)  # and the options, a Redis URL's server included
    if run_id is not None:  # a new id's folder is new
        refuse_to_overwrite(output_dir(options, run_id))
    data = load_dataset(settings["dataset"])
    config = make_config(settings, train_samples=len(data.train))  # type: ignore[arg-type]
    return run_local(config, options, data, Path(init_from) if init_from else None,
                     left_to_gemq(settings))


def _spec(value: ModelSpec | DatasetSpec) -> str:
    return value if isinstance(value, str) else spec_of(value)


#: What a run leaves in its output folder (beside dashboard.log, with --dashboard); the
#: results are what a second run of the same name must not replace.
SUMMARY_FILE, CONFIG_FILE = "summary.json", "config.toml"
RESULT_FILES = (MODEL_FILE, SUMMARY_FILE, CURVES_FILE)


def output_dir(options: LocalOptions, run_id: str) -> Path:
    return options.out_dir or Path("runs") / run_id


def refuse_to_overwrite(out: Path) -> None:
    """A folder that holds an earlier run's results is not written over: a second
    ``gemq run --run myexp`` would replace the first one's model and curves."""
    if state_file(out).exists():
        raise RunExists(f"{out} holds the state of an interrupted run: continue it with "
                        f"gemq run --resume {out}, or give another --run or --out")
    held = [name for name in RESULT_FILES if (out / name).exists()]
    if held:
        raise RunExists(f"{out} already holds a run's results ({', '.join(held)}); give "
                        "another --run or --out, or move that folder away")


def check_options(options: LocalOptions) -> None:
    """Refuse options that cannot work, each with one error, before anything starts: no
    process, no private Redis, no dataset loaded. A Redis the options name must answer
    within a few seconds."""
    if options.workers < 1:
        raise ConfigError("workers", f"must be at least 1, got {options.workers}")
    if options.worker_processes < 0:
        raise ConfigError("worker_processes", f"must be 0 (automatic) or more, got "
                                              f"{options.worker_processes}")
    resolve_device(options.device)  # one error here, not one per worker process
    if options.local_cluster and options.redis_url:
        raise ConfigError("local_cluster", "starts a private cluster: give it or a Redis URL, "
                                           "not both")
    if not 0 <= options.local_cluster <= MAX_LOCAL_MASTERS:
        raise ConfigError("local_cluster", f"masters must be 0 (none) to {MAX_LOCAL_MASTERS}, "
                                           f"got {options.local_cluster}")
    if options.tensorboard is not None:
        require_tensorboard()
    if options.redis_url:
        wait_until_ready(options.redis_url, COMMAND_WAIT_S)


def run_local(config: RunConfig, options: LocalOptions, data: DataSplit | None = None,
              init_from: Path | None = None, left_to_gemq: Collection[str] = ()
              ) -> RunSummary:
    """Run ``config`` to its end on this machine (``data``: its dataset, if loaded;
    ``init_from``: a state_dict file to start from; ``left_to_gemq``: the settings gemq
    chooses for the model, the workers and the Redis, gemq.running.sizing)."""
    check_options(options)
    out = output_dir(options, config.run_id)
    refuse_to_overwrite(out)
    data = data or load_dataset(config.dataset)
    # SIGTERM and SIGHUP unwind like Ctrl-C: children stopped, the private Redis with them.
    with raise_on_termination(), local_redis(options, out) as (url, state), \
            connected(url) as client:
        # A private Redis shares this machine; a Redis the user brings says its own room.
        room = (None if options.redis_url
                else Room.of_this_machine(masters=options.local_cluster or 1))
        store, sizing = create_sized(client, config, *initial_state(config, data, init_from),
                                     left_to_gemq=left_to_gemq, workers=options.workers,
                                     room=room)
        if sizing.differs_from_defaults():
            print(f"run {config.run_id}: {sizing.describe()}", file=sys.stderr, flush=True)
        if options.redis_url is None:
            refuse_oversized_values(client, store, sizing.config)
        return train_run(url, state, client, store, options, data, out, sizing=sizing)


def train_run(url: str, state: SavedState | None, client: redis.Redis, store: RunStore,
              options: LocalOptions, data: DataSplit, out: Path,
              resumed: bool = False, sizing: Sizing | None = None) -> RunSummary:
    """Train ``store``'s run (new, or ``resumed``) to its end with this machine's processes,
    writing its results to ``out`` (or, if the disk refuses them there, to the folder a
    warning names: gemq.records.runfolder); ``state``: the private Redis' saved state, if
    any; ``sizing``: how a new run's settings were chosen."""
    config = store.config()
    model = build_model(config.model, data.in_features, data.num_classes)
    started, started_ms = time.monotonic(), now_ms()
    folder = RunFolder(out, config.run_id, (CONFIG_FILE, *RESULT_FILES))
    chosen = sizing.chosen if sizing else ()
    _write_config_file(folder, config, options, chosen)
    with local_dashboard(url, options.dashboard, out / "dashboard.log") as dashboard:
        if dashboard is not None:
            print(f"run {config.run_id}: dashboard at {dashboard.url}", file=sys.stderr,
                  flush=True)
        model_file = ModelFile(store, model, folder)
        if state is not None:
            state.arm(client)
        try:
            with CurveRecorder(store, folder, options.tensorboard, append=resumed) as curves:
                _supervise(url, store, config, options, model_file, curves,
                           lambda: state.save_if_due(client) if state else None)
            for shard in store.shards():  # again: workers published after it
                release_if_ended(shard, store.state())
        except BaseException:  # Ctrl-C, SIGTERM, a failed run: keep what was learnt
            model_file.save_on_the_way_out()
            keep_for_resume(store, state, url, out, model_file.path, options)
            raise
        if state is not None:
            state.discard(client)
        summary = run_totals(store)
        # Heard from during this call: a resumed run's earlier workers are not counted.
        summary["workers_joined"] = len(store.workers_since(started_ms)
                                        - set(_worker_ids(config.run_id, options.workers)))
        summary["redis"] = (redact(options.redis_url) if options.redis_url
                            else f"embedded cluster of {options.local_cluster} masters"
                            if options.local_cluster else "embedded")
        summary["redis_peak_mb"] = round(sum(memory_figures(client, "used_memory_peak"))
                                         / 2**20, 1)
        if sizing is not None:
            summary["chosen_by_gemq"] = chosen
            summary["redis_bound_mb"] = round(sizing.redis_bytes / 2**20, 1)
        model_file.save()
        _write_config_file(folder, config, options, chosen)  # again if the folder was removed
        summary["wall_time_s"] = round(time.monotonic() - started, 3)
        result = _finish(config, options, data, model, folder, summary)
        if dashboard is not None:
            accuracy = (f", test accuracy {100 * result.test_accuracy:.1f}%"
                        if result.test_accuracy is not None else "")
            dashboard.linger(f"run {config.run_id} {result.state}{accuracy}")
    return result


@contextlib.contextmanager
def connected(url: str) -> Iterator[redis.Redis]:
    client = connect(url)
    try:
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def local_redis(options: LocalOptions, out: Path) -> Iterator[tuple[str, SavedState | None]]:
    """The URL of the run's Redis, and its saved state: the private Redis of a run keeps
    its data in the run's folder (gemq.running.savedstate); a Redis the user names, or a
    private cluster, keeps none there."""
    if options.redis_url:
        yield options.redis_url, None
        return
    if options.local_cluster:
        with EmbeddedCluster(options.local_cluster, die_with_owner=True) as cluster:
            log.info("started a private Redis Cluster on ports %s", cluster.ports)
            yield cluster.url, None
        return
    state = SavedState(out)
    try:
        with state.server() as server:
            log.info("started a private redis-server on port %d", server.port)
            yield server.url, state
    finally:
        state.remove()


def keep_for_resume(store: RunStore, state: SavedState | None, url: str, out: Path,
                    model: Path, options: LocalOptions) -> None:
    """An interrupted run that has not ended keeps its state, and says how to go on; one
    that has (failed, or finished as it was interrupted) keeps none."""
    try:
        running = store.state() not in ENDED
    except redis.RedisError as e:
        log.warning("could not read the run's state on the way out: %s", e)
        return
    if not running:
        if state is not None:
            with contextlib.suppress(redis.RedisError), connect(url) as client:
                state.discard(client)
        return
    if options.local_cluster:
        log.warning("the run's state lived in its private cluster, which stops now: start "
                    "a new run from the model with --init-from %s", model)
        return
    if state is None:
        log.warning("the run stays in the Redis at %s: continue it with gemq run --resume "
                    "%s --redis-url URL", redact(url), store.run_id)
    elif state.keep(url):
        log.warning("saved the run's whole state to %s: continue it with gemq run "
                    "--resume %s", state.file, out)


def refuse_oversized_values(client: redis.Redis, store: RunStore, config: RunConfig) -> None:
    """Make the private Redis refuse any value larger than this run's largest legal one (a
    parameter vector or a gradient message): an oversized stream entry is then refused when
    it is written, and never reaches the aggregator's memory."""
    largest = largest_value(config, store.plan())
    on_every_node = {"target_nodes": "all"} if is_cluster(client) else {}
    client.config_set("proto-max-bulk-len", max(MIN_BULK_LEN, largest + BULK_LEN_SLACK),
                      **on_every_node)


def _supervise(url: str, store: RunStore, config: RunConfig, options: LocalOptions,
               model_file: ModelFile, curves: CurveRecorder,
               save_state_if_due: Callable[[], None]) -> None:
    """Start the processes, show progress, and wait for the aggregator to end the run."""
    context = mp.get_context("spawn")
    aggregators = [context.Process(target=aggregator_main,
                                   name="gemq-aggregator" + (f"-{k}" if k else ""),
                                   args=(url, config.run_id, options.lease_ms, k))
                   for k in range(config.shards)]
    workers = [context.Process(target=worker_main, name=f"gemq-worker-{i}",
                               args=(url, config.run_id, ids, options.device,
                                     LOCAL_WORKER_NICENESS))
               for i, ids in enumerate(_worker_groups(config.run_id, options))]
    processes: list[BaseProcess] = [*aggregators, *workers]
    shards = f" for {config.shards} shards" if config.shards > 1 else ""
    display = ProgressDisplay(
        store, config.budget_updates, enabled=options.progress,
        starting=f"run {config.run_id}: starting {len(aggregators)} aggregator"
                 f"{'s' if len(aggregators) > 1 else ''}{shards} and {options.workers} "
                 f"workers ({config.algo}, {config.model} on {config.dataset}, "
                 f"{config.budget_updates} updates)")
    advice = budget_advice(config, max(shard.size for shard in store.plan().shards),
                           options.workers)
    note = short_budget_note(config, options.workers)
    for line in (advice, note):
        if options.progress and line:
            print(f"run {config.run_id}: {line}", file=sys.stderr)
    try:
        for process in processes:
            process.start()
        # The aggregators and workers wait a Redis outage out; so does this loop, as long
        # as the run would wait for workers that cannot publish.
        outage = BoundedOutage(f"run {config.run_id}", config.stall_timeout_s,
                               "the run's stall_timeout_s")
        while any(a.is_alive() for a in aggregators):
            aggregators[0].join(0.25)
            try:
                display.poll()
                curves.poll()
                model_file.save_if_due()
                save_state_if_due()
                if not any(w.is_alive() for w in workers):
                    if store.state() in ENDED:  # they left because the run ended
                        for aggregator in aggregators:
                            aggregator.join(10)
                        break
                    raise GemqError("every worker process exited before the run finished; "
                                    f"codes: {[w.exitcode for w in workers]}")
            except TRANSIENT_ERRORS as e:
                outage.wait(e)
                continue
            outage.over()
        display.poll()
        curves.poll()
        display.close()
        status = store.status()
        if status["state"] == RunState.FAILED and status.get("error"):
            raise GemqError(f"run {config.run_id} failed: {status['error']}")
        codes = [a.exitcode for a in aggregators]
        if any(codes) or status["state"] not in (RunState.FINISHED, RunState.STOPPED):
            raise GemqError(f"the aggregator ended with code {_worst(codes)}, run state "
                            f"{status['state']!r}; see the log above")
        for worker in workers:
            worker.join(30)
    finally:
        display.close()
        _terminate(processes)


def _worst(codes: list[int | None]) -> int | None:
    """The exit code to report: the first non-zero one (None: still running)."""
    return next((code for code in codes if code != 0), 0)


def _worker_groups(run_id: str, options: LocalOptions) -> list[list[str]]:
    """Logical worker ids, dealt round-robin over the worker processes."""
    ids = _worker_ids(run_id, options.workers)
    processes = options.worker_processes or min(options.workers, max(4, os.cpu_count() or 1))
    return [ids[i::processes] for i in range(min(processes, len(ids)))]


def _worker_ids(run_id: str, workers: int) -> list[str]:
    return [f"{run_id}-w{i}" for i in range(workers)]


def _terminate(processes: list[BaseProcess]) -> None:
    processes = [p for p in processes if p.pid is not None]  # those that were started
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def _finish(config: RunConfig, options: LocalOptions, data: DataSplit, model: nn.Module,
            folder: RunFolder, summary: dict[str, Any]) -> RunSummary:
    """Evaluate the final model (loaded by the model file) and write the summary, which
    names the folder that holds the results."""
    loss = load_loss(config.loss)
    summary["train_loss"], summary["train_accuracy"] = evaluate(model, data.train, loss=loss)
    summary["test_loss"], summary["test_accuracy"] = evaluate(model, data.test, loss=loss)
    summary["parameters"] = int(sum(p.numel() for p in model.parameters()))
    summary["test_samples"] = len(data.test)  # type: ignore[arg-type]
    if summary["test_accuracy"] is None:  # judged by its loss: against the unigram's
        summary["baseline_loss"] = frequency_loss(data.train, data.test, data.num_classes)
    if summary["state"] == RunState.FINISHED:  # a stopped or failed run says so already
        summary["problems"] = poor_result(
            summary["updates_applied"], summary["rejected"], summary["test_accuracy"],
            majority_share(data.test), summary["test_samples"], summary["test_loss"],
            summary.get("baseline_loss"))
    summary["workers"] = options.workers
    summary["config"] = config
    wall = summary["wall_time_s"]
    summary["updates_per_s"] = round(summary["updates_applied"] / wall, 2) if wall else None

    def write(path: Path) -> RunSummary:
        result = RunSummary(**summary, model_path=path.with_name(MODEL_FILE),
                            summary_path=path)
        result.write_json()
        return result

    return folder.write(SUMMARY_FILE, write)


def _write_config_file(folder: RunFolder, config: RunConfig, options: LocalOptions,
                       chosen: tuple[str, ...]) -> None:
    """The run's settings as ``--config`` takes them back, unless the folder holds them
    (a resumed run's): its training settings (those gemq ``chosen`` as chosen), its budget
    in updates and its workers (not its id, nor where it ran)."""
    if not folder.file(CONFIG_FILE).exists():
        folder.write(CONFIG_FILE, lambda path: _config_file(path, config, options, chosen))


def _config_file(path: Path, config: RunConfig, options: LocalOptions,
                 chosen: tuple[str, ...]) -> None:
    settings = {s.name: getattr(config, s.name) for s in USER_SETTINGS
                if s.group != BUDGET}
    header = (f"gemq run {config.run_id}: run it again with\n"
              f"  gemq run --config {path}\n(flags given beside it win)")
    if chosen:
        names = ", ".join(name.replace("_", "-") for name in chosen)
        header += (f"\n{names}: chosen by gemq for this model, its workers and its Redis "
                   "(\"auto\" chooses again)")
    write_config_file(path, {**settings, "steps": config.budget_updates,
                             "workers": options.workers, "device": options.device}, header)
