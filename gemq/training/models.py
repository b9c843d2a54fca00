"""Built-in models: the GEM paper's MNIST CNN, a small residual CNN with BatchNorm, an MLP,
logistic regression and a small decoder-only transformer for byte-level text
(gemq.training.transformer, trained on ``--dataset pysource``); and the state layout of any
model."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gemq.errors import SpecError
from gemq.layout import BUFFER_DTYPES, ParamLayout
from gemq.training import text
from gemq.training.specs import call_factory, is_import_spec
from gemq.training.transformer import Transformer


class PaperCNN(nn.Module):
    """The MNIST CNN of Hermans & Louppe (2018): 163,790 parameters on 1x28x28 inputs."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 300)
        self.fc2 = nn.Linear(300, 200)
        self.fc3 = nn.Linear(200, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 28, 28)
        x = torch.relu(torch.max_pool2d(self.conv1(x), 2))
        x = torch.relu(torch.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return torch.log_softmax(self.fc3(x), dim=1)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to the input (projected when the shape
    changes), as in He et al. (2016)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A residual CNN for 1x28x28 inputs, sized for a few CPU cores: a strided 5x5 stem
    (14x14), then blocks at 14x14, 7x7 and 4x4 with 16, 32 and 64 channels, global average
    pooling and a linear layer; 78,010 parameters and BatchNorm buffers. Outputs logits."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 5, 2, 2, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = ResidualBlock(width, width, 1)
        self.layer2 = ResidualBlock(width, 2 * width, 2)
        self.layer3 = ResidualBlock(2 * width, 4 * width, 2)
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x.view(-1, 1, 28, 28))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(dim=(2, 3)))


class MLP(nn.Module):
    def __init__(self, in_features: int = 784, hidden: int = 256, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes), nn.LogSoftmax(dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LogisticRegression(nn.Module):
    def __init__(self, in_features: int = 784, num_classes: int = 10) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.linear(x.flatten(1)), dim=1)


#: name -> factory(in_features, num_classes)
BUILTIN_MODELS: dict[str, Callable[[int, int], nn.Module]] = {
    "cnn": lambda in_features, classes: PaperCNN(classes),
    "resnet": lambda in_features, classes: SmallResNet(classes),
    "mlp": lambda in_features, classes: MLP(in_features, num_classes=classes),
    "logreg": lambda in_features, classes: LogisticRegression(in_features, classes),
    "transformer": lambda in_features, classes: Transformer(vocab=classes,
                                                            context=in_features),
}


#: Built-in models that take 1x28x28 images.
IMAGE_MODELS = ("cnn", "resnet")

#: Built-in models of byte-level text (gemq.training.text): a sample is ``in_features`` byte
#: values, its target the next byte at each position, and ``num_classes`` the vocabulary,
#: 256. build_model tells a text dataset by those 256 classes: the built-in image and
#: tabular datasets have 10.
TEXT_MODELS = ("transformer",)


def build_model(spec: str, in_features: int, num_classes: int) -> nn.Module:
    """A fresh model for ``spec``: a built-in name or a ``module:factory`` returning one."""
    if spec in IMAGE_MODELS and in_features != 784:
        raise SpecError(f"model {spec!r} needs 28x28 inputs; this dataset has {in_features} "
                        "features (try --model mlp)")
    if spec in TEXT_MODELS and num_classes != text.VOCAB:
        raise SpecError(f"model {spec!r} needs byte-level text (256 token values); this "
                        f"dataset has {num_classes} classes (try --dataset pysource)")
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec](in_features, num_classes)
    if not is_import_spec(spec):
        raise SpecError(f"unknown model {spec!r}: use one of {', '.join(BUILTIN_MODELS)} "
                        "or 'package.module:factory'")
    model = call_factory(spec, "model")
    if not isinstance(model, nn.Module):
        raise SpecError(f"model {spec!r} returned {type(model).__name__}, not a torch "
                        "nn.Module")
    return model


def layout_of(model: nn.Module) -> ParamLayout:
    """The model's parameters, then its persistent buffers (those in its state_dict):
    everything a worker's step changes and a saved model holds, with each buffer's
    moving-average momentum (_buffer_momenta). Raises SpecError for a buffer whose dtype the
    flat float32 state cannot carry."""
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    momenta = _buffer_momenta(model)
    return ParamLayout.from_shapes(params, [(name, tuple(b.shape), _dtype_name(name, b),
                                             momenta.get(name, 0.0))
                                            for name, b in state_buffers(model)])


def _buffer_momenta(model: nn.Module) -> dict[str, float]:
    """The buffers that are exponential moving averages, by name, with their momentum m:
    the running mean and variance of a normalisation layer that tracks running statistics
    with a number for momentum (BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm with
    ``track_running_stats``). A training step makes them ``(1 - m) v + m b``, b the batch's
    statistic. Not here (their changes are added as they are): the batch count, a layer
    with ``momentum=None`` (a cumulative average, whose weight is 1 / batch count), and any
    other buffer."""
    momenta: dict[str, float] = {}
    for prefix, module in model.named_modules():
        momentum = getattr(module, "momentum", None)
        if (isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
                and isinstance(momentum, int | float) and not isinstance(momentum, bool)):
            for name in ("running_mean", "running_var"):
                if isinstance(getattr(module, name, None), torch.Tensor):
                    momenta[f"{prefix}.{name}" if prefix else name] = float(momentum)
    return momenta


def state_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state_dict holds (non-persistent ones stay each worker's own)."""
    saved = model.state_dict(keep_vars=True)
    return [(name, b) for name, b in model.named_buffers() if name in saved]


def _dtype_name(name: str, buffer: torch.Tensor) -> str:
    dtype = str(buffer.dtype).removeprefix("torch.")
    if dtype not in BUFFER_DTYPES:
        raise SpecError(f"buffer {name!r} is {dtype}: gemq carries buffers of "
                        f"{', '.join(BUFFER_DTYPES)} only")
    return dtype
