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


class FlatLoader:
    """Loads flat parameter vectors into one model, with a single copy each time.

    The model's parameters become views into one float32 buffer, so a new vector is one
    ``copyto`` (plus one transfer to the device) instead of a tensor built from the array
    and then split into every parameter. As with ``load_flat``, every parameter is float32
    from then on (the wire format's type). A model spread over several devices keeps its
    own storage and is loaded through ``load_flat``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = list(model.parameters())
        devices = {p.device for p in params}
        self._flat: torch.Tensor | None = None
        if not params or len(devices) != 1:
            return
        flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32,
                           device=params[0].device)
        offset = 0
        with torch.no_grad():
            for p in params:
                view = flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()
        self._flat = flat
        self._host = flat if flat.device.type == "cpu" else torch.empty_like(flat,
                                                                          device="cpu")

    def load(self, values: np.ndarray) -> None:
        if self._flat is None:
            load_flat(self.model, values)
            return
        np.copyto(self._host.numpy(), values, casting="same_kind")
        if self._host is not self._flat:
            self._flat.copy_(self._host)


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
