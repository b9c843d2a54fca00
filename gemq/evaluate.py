"""Evaluating and saving models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def load_flat(model: nn.Module, flat: np.ndarray) -> None:
    """Copy a flat float32 parameter vector into ``model`` (in named_parameters order)."""
    vector = torch.tensor(np.asarray(flat, dtype=np.float32))
    torch.nn.utils.vector_to_parameters(vector.to(next(model.parameters()).device),
                                        model.parameters())


def flat_params(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 1000) -> tuple[float, float]:
    """(mean negative log-likelihood, accuracy) of a log-softmax model on ``dataset``."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += float(nn.functional.nll_loss(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
        count += len(y)
    model.train()
    return loss_sum / max(count, 1), correct / max(count, 1)


def save_state_dict(model: nn.Module, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path
