"""``DataSplit``: a dataset's training and held-out parts, and the shape a model needs."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset


@dataclass(frozen=True)
class DataSplit:
    train: Dataset
    test: Dataset
    #: Inputs per sample (for text: the context, in tokens).
    in_features: int
    #: Classes of the targets (for text: the vocabulary).
    num_classes: int
