"""The built-in text workload: the ``pysource`` corpus (gemq/training/text.py), the
decoder-only transformer (gemq/training/transformer.py) and the two together in gemq."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from gemq import cli
from gemq.config import RunConfig
from gemq.errors import SpecError
from gemq.sim.engine import simulate
from gemq.sim.options import SimOptions
from gemq.sim.results import SimResult
from gemq.training import text, transformer
from gemq.training.data import DataSplit, load_dataset, minibatches
from gemq.training.models import build_model
from gemq.training.transformer import Transformer


@pytest.fixture(scope="module")
def corpus() -> text.Corpus:
    return text.pysource_corpus()


@pytest.fixture(scope="module")
def split() -> DataSplit:
    return load_dataset("pysource")


def _tensors(dataset: object) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(dataset, TensorDataset)
    x, y = dataset.tensors
    return x, y


# --- the corpus ---------------------------------------------------------------------------


def test_the_corpus_is_the_same_bytes_on_every_read(corpus: text.Corpus,
                                                     split: DataSplit) -> None:
    again = text.read_corpus(text.stdlib_folder())  # not the cached one
    assert again == corpus
    assert load_dataset("pysource") is split  # read once per process
    for ours, theirs in ((split.train, text.split_of(again).train),
                         (split.test, text.split_of(again).test)):
        for a, b in zip(_tensors(ours), _tensors(theirs), strict=True):
            assert torch.equal(a, b)


def test_train_and_heldout_come_from_different_files(corpus: text.Corpus) -> None:
    root = text.stdlib_folder()
    assert corpus.train_files and corpus.heldout_files
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    assert not any(text.is_heldout(f) for f in corpus.train_files)
    assert all(zlib.crc32(f.encode()) % 10 == 0 for f in corpus.heldout_files)
    for files, part, cap in ((corpus.train_files, corpus.train, text.TRAIN_BYTES),
                             (corpus.heldout_files, corpus.heldout, text.HELDOUT_BYTES)):
        assert list(files) == text.reading_order(list(files))
        assert len(part) == cap
        assert part == b"".join((root / f).read_bytes()[:text.FILE_BYTES]
                                for f in files)[:cap]
        assert not any({"test", "tests", "site-packages", "idlelib"} & set(f.split("/"))
                       for f in files)


def test_samples_are_windows_whose_targets_are_the_next_bytes(corpus: text.Corpus,
                                                              split: DataSplit) -> None:
    assert (split.in_features, split.num_classes) == (text.CONTEXT, 256)
    for dataset, part in ((split.train, corpus.train), (split.test, corpus.heldout)):
        x, y = _tensors(dataset)
        windows = (len(part) - 1) // text.CONTEXT
        assert x.shape == y.shape == (windows, text.CONTEXT)
        assert x.dtype == y.dtype == torch.int64
        assert bytes(x.flatten().to(torch.uint8).tolist()) == part[:windows * text.CONTEXT]
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal(y[:-1, -1], x[1:, 0])
        assert int(y[-1, -1]) == part[windows * text.CONTEXT]
        # One tensor of the text under both: the corpus in memory once.
        assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        assert x.untyped_storage().nbytes() <= 8 * len(part)
    x, y = next(minibatches(split.train, 64, seed=1))  # gemq's TensorDataset fast path
    assert x.shape == y.shape == (64, text.CONTEXT)
    assert torch.equal(y[:, :-1], x[:, 1:])


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for relative, content in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(content)


def test_a_small_tree_is_split_by_file_and_capped(tmp_path: Path) -> None:
    kept = {f"m{i}.py": f"# m{i}\n".encode() * 20 for i in range(60)}
    kept["m1.py"] = b"z" * (text.FILE_BYTES + 500)  # gives its first FILE_BYTES only
    kept["pkg/mod.py"] = b"y = 1\n"
    _tree(tmp_path, {**kept, "test/t.py": b"x" * 999, "pkg/tests/t.py": b"x" * 999,
                     "site-packages/s.py": b"x" * 999, "idlelib/i.py": b"x" * 999,
                     "notes.txt": b"x" * 999})
    assert text.source_files(tmp_path) == sorted(kept)
    order = text.reading_order(sorted(kept))
    assert order != sorted(order)  # mixed, not alphabetical
    held = [n for n in order if text.is_heldout(n)]
    trained = [n for n in order if not text.is_heldout(n)]
    assert 0 < len(held) < 15
    small = text.read_corpus(tmp_path, train_bytes=12000, heldout_bytes=300)
    assert (len(small.train), len(small.heldout)) == (12000, 300)
    assert small.train_files == tuple(trained[:len(small.train_files)])
    assert small.heldout_files == tuple(held[:len(small.heldout_files)])
    assert "m1.py" in small.train_files
    for files, part, cap in ((small.train_files, small.train, 12000),
                             (small.heldout_files, small.heldout, 300)):
        assert part == b"".join(kept[n][:text.FILE_BYTES] for n in files)[:cap]


def test_too_little_text_or_no_folder_is_one_clear_error(tmp_path: Path) -> None:
    _tree(tmp_path, {"os.py": b"import sys\n" * 10})
    with pytest.raises(SpecError, match=r"^dataset pysource: the Python standard library's "
                                        r"sources at .* hold 110 training and 0 held-out "
                                        r"bytes"):
        text.read_corpus(tmp_path)
    with pytest.raises(SpecError, match=r"^dataset pysource reads the Python standard "
                                        r"library's sources, but .*nowhere is not a folder"):
        text.read_corpus(tmp_path / "nowhere")


# --- the unigram baseline -----------------------------------------------------------------


def test_unigram_loss_is_a_real_baseline(split: DataSplit) -> None:
    loss = text.unigram_loss(split)
    assert 0 < loss < math.log(256)
    assert 2.5 < loss < 4.0  # source code: far from a uniform guess


def test_unigram_loss_by_hand() -> None:
    x = torch.zeros(1, 3, dtype=torch.int64)
    tiny = DataSplit(TensorDataset(x, torch.tensor([[0, 0, 1]])),
                     TensorDataset(x[:, :2], torch.tensor([[0, 1]])),
                     in_features=3, num_classes=3)
    # counts 2, 1, 0 -> add-one: 3, 2, 1 out of 6
    assert text.unigram_loss(tiny) == pytest.approx(-(math.log(3 / 6) + math.log(2 / 6)) / 2)


# --- the model ----------------------------------------------------------------------------


def test_logits_are_batch_vocabulary_positions() -> None:
    torch.manual_seed(0)
    model = Transformer()
    x = torch.randint(0, 256, (3, text.CONTEXT))
    with torch.no_grad():
        assert model(x).shape == (3, 256, text.CONTEXT)
        assert model(x[:, :10]).shape == (3, 256, 10)
        loss = F.cross_entropy(model(x), x)  # gemq's default loss, per byte
    assert loss.shape == () and abs(float(loss) - math.log(256)) < 0.1  # GPT-2 init
    with pytest.raises(ValueError, match="context is 64"):
        model(torch.zeros(1, 65, dtype=torch.int64))


def test_a_byte_changes_no_logit_before_it() -> None:
    torch.manual_seed(0)
    model = Transformer().eval()
    x = torch.randint(0, 256, (2, text.CONTEXT))
    with torch.no_grad():
        before = model(x)
        for t in (0, 17, text.CONTEXT - 1):
            changed = x.clone()
            changed[:, t] = (changed[:, t] + 1) % 256
            after = model(changed)
            torch.testing.assert_close(after[:, :, :t], before[:, :, :t], rtol=0, atol=1e-6)
            assert not torch.allclose(after[:, :, t], before[:, :, t])


def test_the_parameter_count_in_the_docstrings_is_the_real_one() -> None:
    real = sum(p.numel() for p in Transformer().parameters())
    for doc in (transformer.__doc__, Transformer.__doc__):
        stated = re.search(r"(\d[\d,]+)\s+parameters", doc or "")
        assert stated, doc
        assert int(stated.group(1).replace(",", "")) == real
    built = build_model("transformer", text.CONTEXT, 256)
    assert sum(p.numel() for p in built.parameters()) == real
    d, layers = 128, 2  # the formula Transformer's docstring gives, at another size
    small = Transformer(vocab=256, context=64, d_model=d, layers=layers, heads=4)
    formula = layers * (12 * d * d + 13 * d) + (256 + 64) * d + 2 * d + (d + 1) * 256
    assert sum(p.numel() for p in small.parameters()) == formula


def test_momentum_sgd_lowers_the_loss(split: DataSplit) -> None:
    """gemq's default proxy (momentum SGD, lr 0.05, momentum 0.9), a few dozen steps; a
    small model of the same code, for speed."""
    torch.manual_seed(0)
    model = Transformer(d_model=64, layers=2, heads=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x_test, y_test = (t[:256] for t in _tensors(split.test))

    def heldout() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(x_test), y_test))

    first = heldout()
    batches = minibatches(split.train, 64, seed=0)
    for _ in range(40):
        x, y = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert heldout() < first - 1.0


# --- in gemq ------------------------------------------------------------------------------


def _comparable(result: SimResult) -> str:
    data = result.to_dict()
    for timing in ("wall_s", "eval_s", "gradients_per_s", "gradients_per_cpu_s"):
        data["summary"].pop(timing)
    return json.dumps(data, sort_keys=True)


def test_simulate_trains_the_transformer_deterministically(split: DataSplit) -> None:
    config = RunConfig.from_dict({"run_id": "t", "model": "transformer",
                                  "dataset": "pysource", "budget_updates": 6})
    options = SimOptions(workers=2, eval_every=3, eval_samples=64)
    first, second = (simulate(config, options, data=split) for _ in range(2))
    assert _comparable(first) == _comparable(second)
    summary = first.to_dict()["summary"]
    assert summary["updates"] == 6
    assert 0 < summary["test_loss"] < math.log(256) + 0.5


def test_the_transformer_on_images_is_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = cli.main(["run", "--model", "transformer", "--dataset", "mnist5k", "--steps", "5",
                     "--no-progress"])
    out, err = capsys.readouterr()
    result = subprocess.CompletedProcess(["gemq"], code, out, err)
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "gemq: error: model 'transformer' needs byte-level text (256 token values); this "
        "dataset has 10 classes (try --dataset pysource)"]
    assert result.returncode == 1


@pytest.mark.slow
def test_gemq_run_trains_the_transformer_with_adam_and_states_the_unigram_baseline(
        tmp_path: Path, split: DataSplit) -> None:
    """The whole system (private Redis, worker processes, the aggregator's Adam rule) on
    the text workload; the summary carries the unigram baseline beside the test loss."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "gemq", "run", "--model", "transformer", "--dataset", "pysource",
         "--optimizer",
         "adam", "--workers", "2", "--batch-size", "16", "--steps", "60", "--no-progress",
         "--accept-poor-result", "--out", str(out)],
        capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates_applied"] == 60 and summary["test_accuracy"] is None
    assert summary["baseline_loss"] == pytest.approx(text.unigram_loss(split), rel=1e-6)
    assert math.isfinite(summary["test_loss"]) and summary["test_loss"] < math.log(256)
    assert (f"test loss: {summary['test_loss']:.4f}, unigram baseline "
            f"{summary['baseline_loss']:.4f}") in done.stdout
