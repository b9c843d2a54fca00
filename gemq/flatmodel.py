"""The worker step: a model whose parameters and gradient are flat float32 vectors.

``FlatModel`` is what a worker (gemq/worker.py) and a simulated worker (gemq/sim/engine.py)
compute with, so the simulator runs the very same step as a real worker. Parameters become
views into one float32 buffer in the layout's (``named_parameters``) order: loading a
published vector is one copy (plus one transfer to the device), and the gradient is
gathered into one preallocated flat buffer, ready for the wire.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def load_flat(model: nn.Module, flat: np.ndarray) -> None:
    """Copy a flat float32 parameter vector into ``model`` (in named_parameters order)."""
    vector = torch.tensor(np.asarray(flat, dtype=np.float32))
    torch.nn.utils.vector_to_parameters(vector.to(next(model.parameters()).device),
                                        model.parameters())


def flat_params(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()


class FlatModel:
    """One model on one device, loaded from and differentiated into flat vectors.

    Every parameter is float32 from then on (the wire format's type). A model whose
    parameters sit on several devices keeps its own storage and is loaded through
    ``load_flat``.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = model.to(device).train()
        self.params = list(model.parameters())
        self.device = torch.device(device)
        self.size = sum(p.numel() for p in self.params)
        self._flat = self._as_views_of_one_buffer() if self._one_device() else None
        self._host = (self._flat if self._flat is not None and self.device.type == "cpu"
                      else torch.empty(self.size, dtype=torch.float32))
        self._grad = torch.zeros(self.size, dtype=torch.float32, device=self.device)
        self._grad_host = (self._grad if self.device.type == "cpu"
                           else torch.empty(self.size, dtype=torch.float32,
                                            pin_memory=torch.cuda.is_available()))

    def _one_device(self) -> bool:
        return bool(self.params) and len({p.device for p in self.params}) == 1

    def _as_views_of_one_buffer(self) -> torch.Tensor:
        flat = torch.empty(self.size, dtype=torch.float32, device=self.params[0].device)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                view = flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()
        return flat

    @property
    def values(self) -> np.ndarray:
        """The parameters as a flat float32 array (a copy unless they live on the CPU)."""
        if self._flat is not None and self._flat.device.type == "cpu":
            return self._flat.numpy()
        return flat_params(self.model)

    def load(self, values: np.ndarray) -> None:
        """Make the model's parameters ``values`` (flat float32, layout order)."""
        if self._flat is None:
            load_flat(self.model, values)
            return
        np.copyto(self._host.numpy(), values, casting="same_kind")
        if self._host is not self._flat:
            self._flat.copy_(self._host, non_blocking=False)

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, np.ndarray]:
        """Mean NLL of one minibatch and its flat gradient.

        The gradient array is a buffer of this object, overwritten by the next call:
        encode or apply it before computing another.
        """
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        self.model.zero_grad(set_to_none=True)
        loss = nn.functional.nll_loss(self.model(x), y)
        loss.backward()
        # A parameter the forward pass did not use has no gradient: zero, in its place.
        grads = [p.grad.reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), device=self.device) for p in self.params]
        torch.cat(grads, out=self._grad)
        if self._grad_host is not self._grad:
            self._grad_host.copy_(self._grad)
        return float(loss.detach()), self._grad_host.numpy()
