"""Evaluating and saving models."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gemq.training.losses import LossFunction


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 1000,
             loss: LossFunction = nn.functional.cross_entropy) -> tuple[float, float | None]:
    """(mean loss, accuracy) of ``model`` in evaluation mode on ``dataset``, with the loss
    the run trains with. Accuracy is the share of argmax predictions equal to the target,
    where targets are class indices (integers, one per sample, and one output per class);
    otherwise None."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum, correct, count, classified = 0.0, 0, 0, True
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += float(loss(out, y)) * len(y)  # a mean over the batch
        hits = class_hits(out, y) if classified else None
        classified = hits is not None
        correct += int(hits) if hits is not None else 0
        count += len(y)
    model.train()
    mean = loss_sum / count if count else math.nan
    return mean, (correct / max(count, 1) if classified else None)


@torch.no_grad()
def majority_share(dataset: Dataset, batch_size: int = 1000) -> float | None:
    """The share of ``dataset``'s samples in its most common class: the accuracy of always
    answering that class. None where the targets are not class indices."""
    counts = class_counts(dataset, batch_size, one_per_sample=True)
    if counts is None:
        return None
    return float(counts.max()) / float(counts.sum())


@torch.no_grad()
def frequency_loss(train: Dataset, test: Dataset, classes: int = 0,
                   batch_size: int = 1000) -> float | None:
    """The cross-entropy, in nats per target, of the training targets' frequencies (add-one
    smoothed over at least ``classes`` classes) on ``test``'s targets: the loss of a model
    that ignores its input; for a language model, the unigram baseline. None where the
    targets are not class indices (of any shape: one per sample, or one per position of a
    sequence)."""
    seen = class_counts(train, batch_size)
    asked = class_counts(test, batch_size)
    if seen is None or asked is None:
        return None
    size = max(len(seen), len(asked), classes)
    seen = nn.functional.pad(seen, (0, size - len(seen))).double() + 1
    asked = nn.functional.pad(asked, (0, size - len(asked))).double()
    log_p = seen.log() - math.log(float(seen.sum()))
    return float(-(asked * log_p).sum() / asked.sum())


def class_counts(dataset: Dataset, batch_size: int = 1000,
                 one_per_sample: bool = False) -> torch.Tensor | None:
    """How many targets of ``dataset`` are each class, where the targets are class indices
    (integers >= 0; ``one_per_sample``: one per sample only); otherwise None."""
    counts: torch.Tensor | None = None
    for _, y in DataLoader(dataset, batch_size=batch_size):
        if (y.dtype.is_floating_point or y.dtype == torch.bool
                or (one_per_sample and y.dim() != 1) or bool((y < 0).any())):
            return None
        batch = torch.bincount(y.reshape(-1))
        if counts is None:
            counts = batch
        else:
            size = max(len(counts), len(batch))
            counts = (nn.functional.pad(counts, (0, size - len(counts)))
                      + nn.functional.pad(batch, (0, size - len(batch))))
    return counts


def class_hits(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """How many argmax predictions of ``out`` equal ``target``, where the targets are class
    indices (integers, one per sample, and one output per class); otherwise None. The count
    is a 0-d tensor on ``out``'s device: reading it waits for the device, so a caller in
    the middle of a step reads it once the step's own sync has happened."""
    if not (target.dim() == 1 and not target.dtype.is_floating_point
            and out.dim() == 2 and out.shape[1] > 1):
        return None
    return (out.detach().argmax(1) == target).sum()


def save_state_dict(model: nn.Module, path: Path) -> Path:
    """``model``'s state_dict (parameters and buffers) at ``path``, written atomically: a
    reader never sees half a file, even if this process dies while writing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("wb") as f:  # a disk's refusal is an OSError, not torch's own
            torch.save(model.state_dict(), f)
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path
