"""Evaluating and saving models."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


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
