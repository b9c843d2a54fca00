"""Losses a run trains and evaluates with: built-in names or ``package.module:function``.

``cross_entropy`` (the default) takes the model's outputs as logits, the usual PyTorch
convention; it is also right for models that end in ``log_softmax`` (the built-in ones),
since log_softmax of log-probabilities gives them back unchanged. ``nll`` takes
log-probabilities only. A function given as a spec is called as ``f(output, target)`` and
must return the minibatch's mean loss as a scalar tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gemq.errors import SpecError
from gemq.training.specs import is_import_spec, load_factory

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

BUILTIN_LOSSES: dict[str, LossFunction] = {
    "cross_entropy": nn.functional.cross_entropy,
    "nll": nn.functional.nll_loss,
}


def load_loss(spec: str) -> LossFunction:
    """The loss function a run's ``loss`` setting names."""
    if spec in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[spec]
    if not is_import_spec(spec):
        raise SpecError(f"unknown loss {spec!r}: use one of {', '.join(BUILTIN_LOSSES)} or "
                        "'package.module:function'")
    return load_factory(spec, "loss")


def checked_loss(loss: LossFunction, spec: str, output: torch.Tensor,
                 target: torch.Tensor) -> torch.Tensor:
    """``loss(output, target)``, refused with a clear error unless it is a scalar."""
    value = loss(output, target)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise SpecError(f"loss {spec!r} must return the minibatch's mean as a scalar tensor, "
                        f"got {shape}")
    return value.reshape(())
