"""The worker step: a model whose state and gradient are flat float32 vectors.

``FlatModel`` is what a worker (gemq/training/worker.py) and a simulated worker (gemq/sim/engine.py)
compute with, so the simulator runs the very same step as a real worker. The flat state is
the layout's (gemq/layout.py): parameters, then persistent buffers. Parameters become views
into one float32 buffer: loading a published vector is one copy (plus one transfer to the
device). A step's output has the same layout: the loss's gradient for the parameters, then
the change the step made to each buffer (BatchNorm's running statistics, its batch count),
which the aggregator applies to the run's buffers (gemq/aggregation/rules.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from gemq.errors import ConfigError
from gemq.layout import ParamLayout
from gemq.training.evaluate import class_hits
from gemq.training.losses import LossFunction, checked_loss
from gemq.training.models import state_buffers

#: Mixed-precision settings of a run (RunConfig.amp): what autocast computes in.
AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def flat_state(model: nn.Module) -> np.ndarray:
    """The model's parameters and persistent buffers as one float32 vector (layout order)."""
    parts = [p.detach().reshape(-1).float() for p in model.parameters()]
    parts += [b.detach().reshape(-1).float() for _, b in state_buffers(model)]
    return torch.cat(parts).cpu().numpy() if parts else np.zeros(0, np.float32)


def load_flat(model: nn.Module, flat: np.ndarray) -> None:
    """Copy a flat state vector into ``model``: parameters, then persistent buffers."""
    vector = torch.from_numpy(np.array(flat, dtype=np.float32))  # a copy: flat may be read-only
    params = list(model.parameters())
    size = sum(p.numel() for p in params)
    torch.nn.utils.vector_to_parameters(vector[:size].to(params[0].device), params)
    _load_buffers([b for _, b in state_buffers(model)], vector[size:])


def state_dict_of(layout: ParamLayout, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """A state_dict built from a run's layout and a flat state vector alone: no model is
    built, so no code named in a run's configuration runs. It loads into the model with
    ``load_state_dict``, buffers in their own dtypes."""
    return {t.name: _as_dtype(torch.from_numpy(flat[t.slice].reshape(t.shape).copy()),
                              getattr(torch, t.dtype))
            for t in layout.tensors}


def _load_buffers(buffers: list[torch.Tensor], values: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for buffer in buffers:
            part = values[offset:offset + buffer.numel()].view_as(buffer)
            buffer.copy_(_as_dtype(part.to(buffer.device), buffer.dtype))
            offset += buffer.numel()


def _as_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 values back to a buffer's dtype: integers rounded, booleans thresholded."""
    if dtype == torch.bool:
        return values > 0.5
    if not dtype.is_floating_point:
        return values.round().to(dtype)
    return values.to(dtype)


class Step(NamedTuple):
    """What one minibatch's step computed."""

    loss: float  # the mean loss of the minibatch
    #: The share of the minibatch's samples whose argmax output is their target, from the
    #: step's own forward pass (training mode); None where the targets are not class
    #: indices (gemq.training.evaluate.class_hits).
    accuracy: float | None
    #: The flat output: the gradient of the parameters, then the buffers' changes. A buffer
    #: of the FlatModel, overwritten by its next step: encode or apply it before then.
    output: np.ndarray


class FlatModel:
    """One model on one device, loaded from and differentiated into flat vectors.

    Every parameter is float32 from then on (the wire format's type). A model whose
    parameters sit on several devices keeps its own storage and is loaded through
    ``load_flat``.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu",
                 loss: LossFunction = nn.functional.cross_entropy,
                 loss_name: str = "cross_entropy", amp: str = "off") -> None:
        self.model = model.to(device).train()
        self.params = list(model.parameters())
        self.buffers = [b for _, b in state_buffers(model)]
        self.device = torch.device(device)
        self.param_size = sum(p.numel() for p in self.params)
        self.size = self.param_size + sum(b.numel() for b in self.buffers)
        self.loss, self.loss_name = loss, loss_name
        self.precision = MixedPrecision(amp, self.device)
        self._flat = self._as_views_of_one_buffer() if self._one_device() else None
        self._host = (self._flat if self._flat is not None and self.device.type == "cpu"
                      else torch.empty(self.param_size, dtype=torch.float32))
        self._out = torch.zeros(self.size, dtype=torch.float32, device=self.device)
        self._out_host = (self._out if self.device.type == "cpu"
                          else torch.empty(self.size, dtype=torch.float32,
                                           pin_memory=torch.cuda.is_available()))

    def _one_device(self) -> bool:
        return bool(self.params) and len({p.device for p in self.params}) == 1

    def _as_views_of_one_buffer(self) -> torch.Tensor:
        flat = torch.empty(self.param_size, dtype=torch.float32, device=self.params[0].device)
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
        """The state as a flat float32 array (a fresh copy)."""
        return flat_state(self.model)

    def load(self, values: np.ndarray) -> None:
        """Make the model's state ``values`` (flat float32, layout order)."""
        if self._flat is None:
            load_flat(self.model, values)
            return
        np.copyto(self._host.numpy(), values[:self.param_size], casting="same_kind")
        if self._host is not self._flat:
            self._flat.copy_(self._host, non_blocking=False)
        if self.buffers:
            _load_buffers(self.buffers, torch.from_numpy(
                np.array(values[self.param_size:], dtype=np.float32)))

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> Step:
        """One minibatch's step: its mean loss, accuracy and flat output (see Step)."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        before = self._buffer_vector() if self.buffers else None
        hits: list[torch.Tensor | None] = []

        def loss_of(out: torch.Tensor) -> torch.Tensor:
            hits.append(class_hits(out, y))  # the outputs the loss is computed from
            return checked_loss(self.loss, self.loss_name, out, y)

        for attempt in range(self.precision.MAX_RETRIES):
            if attempt and before is not None:  # the failed try moved the running stats
                _load_buffers(self.buffers, before)
            loss = self.precision.backward(self.model, self.params, x, loss_of)
            if loss is not None:
                break
        else:
            raise FloatingPointError("float16 gradients overflow at every loss scale")
        # A parameter the forward pass did not use has no gradient: zero, in its place.
        grads = [p.grad.reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), device=self.device) for p in self.params]
        torch.cat(grads, out=self._out[:self.param_size])
        if before is not None:
            torch.sub(self._buffer_vector(), before, out=self._out[self.param_size:])
        if self._out_host is not self._out:
            self._out_host.copy_(self._out)
        correct = hits[-1]  # read after the loss: the device has finished the step by then
        accuracy = None if correct is None or not len(y) else int(correct) / len(y)
        return Step(loss, accuracy, self._out_host.numpy())

    def _buffer_vector(self) -> torch.Tensor:
        return torch.cat([b.detach().reshape(-1).float() for b in self.buffers])


class MixedPrecision:
    """Forward and backward under autocast (``amp``: off, on, bfloat16 or float16; on
    means bfloat16 where the device computes it, float16 on older GPUs).

    bfloat16 has float32's range: gradients need no scaling. float16 does: the loss is
    scaled before backward and the gradients unscaled after, with the scale halved (and
    the step computed again) whenever a gradient overflows, and doubled after
    GROWTH_INTERVAL clean steps, as torch.amp.GradScaler does for an optimizer.
    """

    GROWTH_INTERVAL = 2000
    #: Halvings tried before a step is given up (2**16 down to 2**-8).
    MAX_RETRIES = 24

    def __init__(self, amp: str, device: torch.device) -> None:
        if amp == "on":
            amp = "float16" if device.type == "cuda" and not _cuda_bfloat16() else "bfloat16"
        if amp != "off" and amp not in AMP_DTYPES:
            raise ConfigError("amp", f"must be off, on, {', '.join(AMP_DTYPES)}; got {amp!r}")
        self.amp = amp
        self.dtype = AMP_DTYPES.get(amp)
        self.device = device
        self.scale = 2.0 ** 16 if amp == "float16" else 1.0
        self._clean_steps = 0

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

    def backward(self, model: nn.Module, params: list[nn.Parameter], x: torch.Tensor,
                 loss_of: Callable[[torch.Tensor], torch.Tensor]) -> float | None:
        """Compute the gradients into ``params``; return the loss, or None when float16
        gradients overflowed (the scale is smaller now: try again)."""
        model.zero_grad(set_to_none=True)
        with self._autocast():
            loss = loss_of(model(x))
        (loss.float() * self.scale).backward()
        if self.scale == 1.0 or self._unscaled(params):
            return float(loss.detach())
        return None

    def _unscaled(self, params: list[nn.Parameter]) -> bool:
        """Divide the gradients by the scale; False (and a smaller scale) on overflow."""
        grads = [p.grad for p in params if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.scale /= 2
            self._clean_steps = 0
            return False
        for g in grads:
            g.div_(self.scale)
        self._clean_steps += 1
        if self._clean_steps % self.GROWTH_INTERVAL == 0:
            self.scale *= 2
        return True


def _cuda_bfloat16() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
