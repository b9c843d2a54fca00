"""Creating runs: the seeded (or warm-started) initial state and layout, written to Redis."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import numpy as np
import redis
import torch
from torch import nn

from gemq.config import PLANNED_WORKERS, RunConfig
from gemq.errors import SpecError
from gemq.layout import ParamLayout
from gemq.running.sizing import Room, Sizing, size_run
from gemq.shards import ShardPlan
from gemq.state.serverfit import read_server, refuse_eviction, warn_about_value_limit
from gemq.state.store import RunStore
from gemq.training.data import DataSplit, load_dataset
from gemq.training.flatmodel import flat_state
from gemq.training.losses import load_loss
from gemq.training.models import build_model, layout_of


def create_run(client: redis.Redis, config: RunConfig, data: DataSplit | None = None,
               init_from: Path | None = None, *, left_to_gemq: Collection[str] = (),
               workers: int = PLANNED_WORKERS, room: Room | None = None) -> RunStore:
    """Write a new run to Redis, with the initial state of ``initial_state`` and the
    settings ``left_to_gemq`` chosen for it (gemq.running.sizing) for ``workers`` workers.
    ``room``: where the run goes on a Redis gemq set up; None for a Redis the user brings,
    which is read and checked (gemq.state.serverfit) first. Raises RunExists if the id is
    taken, UnsuitableRedis or RunTooBig for a Redis that cannot hold the run."""
    return create_sized(client, config, *initial_state(config, data, init_from),
                        left_to_gemq=left_to_gemq, workers=workers, room=room)[0]


def create_sized(client: redis.Redis, config: RunConfig, layout: ParamLayout,
                 state: np.ndarray, *, left_to_gemq: Collection[str] = (),
                 workers: int = PLANNED_WORKERS, room: Room | None = None
                 ) -> tuple[RunStore, Sizing]:
    """``create_run`` for a model already laid out; with the Sizing that chose its
    settings."""
    facts = None
    if room is None:
        facts = read_server(client)
        refuse_eviction(facts)
        room = Room.of_server(facts)
    sizing = size_run(config, left_to_gemq, layout, workers, room)
    if facts is not None:
        warn_about_value_limit(facts, sizing.config, ShardPlan.of(layout, sizing.config.shards))
    store = RunStore(client, sizing.config.run_id)
    store.create(sizing.config, layout, state)
    return store, sizing


def initial_state(config: RunConfig, data: DataSplit | None = None,
                  init_from: Path | None = None) -> tuple[ParamLayout, np.ndarray]:
    """The run's layout and first state: the model initialised with the run's seed, or
    loaded from ``init_from`` (a state_dict file: an earlier run's model.pt, say).

    ``data``: the run's dataset (its shape sizes the model), if the caller has loaded it
    already; a dataset factory is otherwise called here. Raises SpecError for a model, loss
    or state_dict file that cannot be used: before anything is written anywhere.
    """
    data = data or load_dataset(config.dataset)
    load_loss(config.loss)  # a loss that cannot be loaded fails here, not in every worker
    torch.manual_seed(config.seed)
    model = build_model(config.model, data.in_features, data.num_classes)
    if init_from is not None:
        load_state_file(model, init_from)
    return layout_of(model), flat_state(model)


def load_state_file(model: nn.Module, path: Path) -> None:
    """Load a state_dict file into ``model``, with errors that say what does not fit."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise SpecError(f"--init-from {path}: no such file") from e
    except Exception as e:  # unpickling refuses in many ways; say which file and why
        raise SpecError(f"--init-from {path}: not a state_dict file torch can load "
                        f"safely: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict):
        raise SpecError(f"--init-from {path}: holds a {type(state).__name__}, not a "
                        "state_dict")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise SpecError(f"--init-from {path} does not fit the model: "
                        f"{' '.join(line.strip() for line in first[:3])}") from e
