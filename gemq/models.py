"""The built-in models under their public name: ``from gemq.models import PaperCNN``.

They live in the training wing (gemq/training/models.py); this module only hands them on,
so that what the README and docs/api.md show keeps working.
"""

from gemq.training.models import (
    IMAGE_MODELS,
    MLP,
    LogisticRegression,
    PaperCNN,
    ResidualBlock,
    SmallResNet,
    build_model,
    layout_of,
    state_buffers,
)

__all__ = ["IMAGE_MODELS", "MLP", "LogisticRegression", "PaperCNN", "ResidualBlock",
           "SmallResNet", "build_model", "layout_of", "state_buffers"]
