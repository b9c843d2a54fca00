"""Creating runs: initial parameters, layout and budget, written to Redis."""

from __future__ import annotations

import math
import secrets
import time

import redis
import torch

from gemq.config import RunConfig
from gemq.data import DataSplit, load_dataset
from gemq.evaluate import flat_params
from gemq.models import build_model, layout_of
from gemq.store import RunStore


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def budget_for(epochs: float, data: DataSplit, batch_size: int) -> int:
    """Updates needed for ``epochs`` passes over the training set, summed over workers."""
    return max(1, math.ceil(epochs * len(data.train) / batch_size))  # type: ignore[arg-type]


def create_run(client: redis.Redis, config: RunConfig,
               data: DataSplit | None = None) -> RunStore:
    """Initialise the model with the run's seed and write the run to Redis."""
    data = data or load_dataset(config.dataset)
    torch.manual_seed(config.seed)
    model = build_model(config.model, data.in_features, data.num_classes)
    store = RunStore(client, config.run_id)
    store.create(config, layout_of(model), flat_params(model))
    return store
