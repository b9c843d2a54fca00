"""Creating runs: the seeded initial parameters and layout, written to Redis."""

from __future__ import annotations

import redis
import torch

from gemq.config import RunConfig
from gemq.data import DataSplit, load_dataset
from gemq.flatmodel import flat_params
from gemq.models import build_model, layout_of
from gemq.store import RunStore


def create_run(client: redis.Redis, config: RunConfig,
               data: DataSplit | None = None) -> RunStore:
    """Initialise the model with the run's seed and write the run to Redis.

    ``data``: the run's dataset (its shape sizes the model), if the caller has loaded it
    already; a dataset factory is otherwise called here. Raises RunExists if the id is taken.
    """
    data = data or load_dataset(config.dataset)
    torch.manual_seed(config.seed)
    model = build_model(config.model, data.in_features, data.num_classes)
    store = RunStore(client, config.run_id)
    store.create(config, layout_of(model), flat_params(model))
    return store
