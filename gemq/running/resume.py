"""``gemq run --resume``: continue an interrupted local run with its whole state.

The state is where the run kept it: the run folder's saved Redis state
(gemq.running.savedstate) for a run on its private Redis, or the Redis the user named
(``--redis-url``), where an interrupted run stays as it was. Either way the run goes on
from its last committed update: parameters, update count and budget, GEM moments,
counters and metrics as they were; metrics.csv goes on from where the state does.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import redis

from gemq.errors import ConfigError, GemqError, RunNotFound
from gemq.records.summary import RunSummary
from gemq.running.local import (
    MODEL_FILE,
    SUMMARY_FILE,
    LocalOptions,
    check_options,
    connected,
    local_redis,
    refuse_oversized_values,
    train_run,
)
from gemq.running.savedstate import state_file
from gemq.state.store import ENDED, RunStore, run_ids
from gemq.training.data import load_dataset


class NothingToResume(GemqError):
    """The folder or run named holds no run that could go on."""


def resume(target: str | Path, options: LocalOptions) -> RunSummary:
    """Continue the interrupted run ``target``: a run folder (``runs/<id>``, or just the id
    of one under runs/), or with ``options.redis_url``, the id of a run in that Redis."""
    check_options(options)
    if options.local_cluster:
        raise ConfigError("local_cluster", "cannot be resumed: a private cluster keeps no "
                                           "state once it stops")
    if options.redis_url:
        run_id = str(target)
        out = options.out_dir or Path("runs") / run_id
    else:
        out = run_folder(target)
        if options.out_dir is not None and options.out_dir.resolve() != out.resolve():
            raise ConfigError("out", f"a resumed run writes to its own folder, {out}")
        run_id = ""  # the one run its saved state holds
    options = replace(options, out_dir=out)
    with local_redis(options, out) as (url, state), connected(url) as client:
        # A run in a Redis others reach may have a live aggregator, or one that died less
        # than a lease ago; nothing else reaches a private Redis.
        lease_s = options.lease_ms / 1000 + 1 if options.redis_url else 0
        store = interrupted_run(client, run_id, str(target), lease_s)
        config = store.config()
        data = load_dataset(config.dataset)
        if options.redis_url is None:
            refuse_oversized_values(client, store, config)
        return train_run(url, state, client, store, options, data, out, resumed=True)


def run_folder(target: str | Path) -> Path:
    """The folder of an interrupted local run: ``target``, or runs/<target>. Raises
    NothingToResume, saying why, when it holds no saved state."""
    path = Path(target)
    if not path.is_dir() and (Path("runs") / path).is_dir():
        path = Path("runs") / path
    if not path.is_dir():
        raise NothingToResume(f"--resume {target}: no such run folder (nor runs/{target})")
    if state_file(path).exists():
        return path
    if (path / SUMMARY_FILE).exists():
        raise NothingToResume(
            f"--resume {target}: the run in {path} has ended (see {path / SUMMARY_FILE}): "
            f"start a new run from its model with --init-from {path / MODEL_FILE}")
    raise NothingToResume(
        f"--resume {target}: {path} holds no saved state; only an interrupted run on a "
        "private Redis keeps one (a run on --redis-url stays in that Redis: give "
        "--resume RUN_ID --redis-url URL)")


def interrupted_run(client: redis.Redis, run_id: str, where: str,
                    lease_s: float = 0) -> RunStore:
    """The run to continue: ``run_id``, or the only run of a saved state (""). Refused,
    saying why, if it has ended or an aggregator still leads it after ``lease_s``."""
    if not run_id:
        ids = run_ids(client)
        if len(ids) != 1:
            raise NothingToResume(f"--resume {where}: its saved state holds {len(ids)} runs, "
                                  "not one")
        run_id = ids[0]
    store = RunStore(client, run_id)
    try:
        state = store.state()
    except RunNotFound as e:
        raise NothingToResume(f"--resume {where}: no run {run_id!r} in that Redis") from e
    if state in ENDED:
        raise NothingToResume(f"--resume {where}: run {run_id} has {state.value}; start a new "
                              "run from its model with --init-from")
    deadline = time.monotonic() + lease_s
    while lease_s and (leader := store.leader()) is not None:
        if time.monotonic() > deadline:
            raise NothingToResume(
                f"--resume {where}: run {run_id} is led by a live aggregator ({leader}): it "
                "was not interrupted (add workers with gemq worker instead)")
        time.sleep(0.2)
    return store
