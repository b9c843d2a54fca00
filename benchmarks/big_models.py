"""Models too big for one Redis value or one aggregator, as ``module:factory`` specs.

    gemq run --model benchmarks.big_models:mlp_11m --dataset mnist5k

Both take MNIST's 784 inputs and give 10 logits (the default ``cross_entropy`` loss).
``MLP_11M`` and ``MLP_150M`` list their parameter shapes, so a benchmark or test can lay
out the same state (``gemq.layout.ParamLayout.from_shapes``) without building the model.
"""

from __future__ import annotations

from typing import Any


def mlp_shapes(*widths: int) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter shapes of ``mlp(*widths)``, named as its state_dict names them."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for index, (fan_in, fan_out) in enumerate(zip(widths, widths[1:], strict=False)):
        layer = 2 * index + 1  # layer 0 is the Flatten, then Linear and ReLU alternate
        shapes += [(f"{layer}.weight", (fan_out, fan_in)), (f"{layer}.bias", (fan_out,))]
    return shapes


#: 784-1200-10: 954,010 parameters (3.6 MB of float32): too big for the values gemq keeps for
#: small models to fit a Redis of 256 MB, small enough to fit once sized.
MLP_1M = (784, 1200, 10)
#: 784-3000-3000-10: 11,388,010 parameters (45.6 MB of float32), ResNet-18's order.
MLP_11M = (784, 3000, 3000, 10)
#: 784-12000-12000-10: 153,552,010 parameters (614 MB of float32): over Redis' 512 MB value
#: limit, so it needs shards (at least 10 of at most 64 MiB each).
MLP_150M = (784, 12000, 12000, 10)


def mlp(*widths: int) -> Any:
    """Linear layers of the given widths with ReLU between them, after a Flatten."""
    from torch import nn  # imported here: the shapes above need no torch

    layers: list[nn.Module] = [nn.Flatten()]
    for fan_in, fan_out in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU after the logits


def mlp_1m() -> Any:
    return mlp(*MLP_1M)


def mlp_11m() -> Any:
    return mlp(*MLP_11M)


def mlp_150m() -> Any:
    return mlp(*MLP_150M)
