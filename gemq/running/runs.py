"""Creating runs: the seeded (or warm-started) initial state and layout, written to Redis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import redis
import torch
from torch import nn

from gemq.config import RunConfig
from gemq.errors import SpecError
from gemq.layout import ParamLayout
from gemq.shards import ShardPlan
from gemq.state.serverfit import check_server
from gemq.state.store import RunStore
from gemq.training.data import DataSplit, load_dataset
from gemq.training.flatmodel import flat_state
from gemq.training.losses import load_loss
from gemq.training.models import build_model, layout_of


def create_run(client: redis.Redis, config: RunConfig, data: DataSplit | None = None,
               init_from: Path | None = None, check_redis: bool = True) -> RunStore:
    """Write a new run to Redis, with the initial state of ``initial_state``. Raises
    RunExists if the id is taken, and UnsuitableRedis for a Redis that could evict the
    run's keys (``check_redis``: gemq.state.serverfit; not for a Redis gemq set up)."""
    layout, state = initial_state(config, data, init_from)
    if check_redis:
        check_server(client, config, ShardPlan.of(layout, config.shards))
    store = RunStore(client, config.run_id)
    store.create(config, layout, state)
    return store


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
