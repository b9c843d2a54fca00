"""Built-in models: the GEM paper's MNIST CNN, an MLP and logistic regression."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gemq.errors import SpecError
from gemq.layout import ParamLayout
from gemq.specs import is_import_spec, load_factory


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
    "mlp": lambda in_features, classes: MLP(in_features, num_classes=classes),
    "logreg": lambda in_features, classes: LogisticRegression(in_features, classes),
}


def build_model(spec: str, in_features: int, num_classes: int) -> nn.Module:
    """A fresh model for ``spec``: a built-in name or a ``module:factory`` returning one."""
    if spec == "cnn" and in_features != 784:
        raise SpecError(f"model 'cnn' needs 28x28 inputs; this dataset has {in_features} "
                        "features (try --model mlp)")
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec](in_features, num_classes)
    if not is_import_spec(spec):
        raise SpecError(f"unknown model {spec!r}: use one of {', '.join(BUILTIN_MODELS)} "
                        "or 'package.module:factory'")
    model = load_factory(spec, "model")()
    if not isinstance(model, nn.Module):
        raise SpecError(f"model {spec!r} returned {type(model).__name__}, not a torch "
                        "nn.Module")
    return model


def layout_of(model: nn.Module) -> ParamLayout:
    return ParamLayout.from_shapes([(name, tuple(p.shape))
                                    for name, p in model.named_parameters()])
