"""``pysource``: byte-level text from the Python standard library's own source files.

The corpus is read at run time from the ``.py`` files of the running Python's standard
library (the folder ``sysconfig.get_paths()["stdlib"]``): nothing is downloaded and nothing
ships with gemq. Left out: ``site-packages`` and ``dist-packages``, every ``test`` or
``tests`` folder (lib2to3's tests among them), ``idlelib``, and any file that cannot be read.

Split by file, deterministically: a file is held out when the CRC-32 of its path relative
to that folder (``zlib.crc32``, POSIX separators) is a multiple of 10 (about a tenth of the
files), else it is a training file; no file gives bytes to both parts. Each part is the
first FILE_BYTES (8 KiB) of each of its files, concatenated, and cut at TRAIN_BYTES (320
KiB, 5,119 samples) or HELDOUT_BYTES (128 KiB, 2,047 samples). The files are taken in a
fixed pseudo-random order (``reading_order``: by the BLAKE2b hash of the path), not
alphabetically: so each part samples the whole library (on Python 3.11, 71 and 23 files),
where the first files in alphabetical order would be mostly one module (``_pydecimal.py``).

The corpus depends on the Python version: each release changes the standard library (3.12
removed ``distutils`` and ``asynchat``, for one; 3.13 removed ``lib2to3``), so which files
exist, what they hold, and with them the text and the losses differ between 3.11 and 3.12
for the same seed. Within one Python version the bytes are the same on every machine.

Tokens are bytes (vocabulary 256). A sample is a non-overlapping window of CONTEXT (64)
bytes: input ``x = text[i:i+T]``, target ``y = text[i+1:i+T+1]`` (the next byte at each
position), both int64; ``DataSplit.in_features`` is CONTEXT and ``num_classes`` 256. Both
are views of one int64 tensor of the text, so a split holds its text once. With gemq's
default batch of 64, an epoch is 80 updates and the default budget (10 epochs) 800.

The baseline a model must beat: ``unigram_loss(split)``, the cross-entropy in nats per byte
of the training bytes' frequencies (add-one smoothing) on the held-out bytes: 3.357 nats per
byte on Python 3.11 (ln 256 = 5.545 is a uniform guess).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from gemq.errors import SpecError
from gemq.training.datasplit import DataSplit
from gemq.training.evaluate import frequency_loss

#: Bytes of a sample's input (and of its target, shifted by one).
CONTEXT = 64
#: Tokens: byte values.
VOCAB = 256
#: Bytes of training text: with batch 64 an epoch is TRAIN_BYTES / 4096 updates, so this
#: sets the default budget (10 epochs: 800 updates).
TRAIN_BYTES = 320 * 1024
#: Bytes of held-out text.
HELDOUT_BYTES = 128 * 1024
#: Bytes a file gives at most (its first ones): each part draws on many files.
FILE_BYTES = 8 * 1024
#: Folders (at any depth) whose files are left out.
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                             "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """The text of both parts and the files each part drew from (relative paths)."""

    train: bytes
    heldout: bytes
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]


def stdlib_folder() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """Whether the file at ``relative_path`` (POSIX separators) belongs to the held-out part."""
    return zlib.crc32(relative_path.encode()) % 10 == 0


def reading_order(files: list[str]) -> list[str]:
    """``files`` in the order the corpus takes them: by the BLAKE2b hash of the path, a
    fixed order that mixes the library's folders."""
    return sorted(files, key=lambda f: (hashlib.blake2b(f.encode(), digest_size=8).digest(), f))


def source_files(root: Path) -> list[str]:
    """The relative paths of ``root``'s ``.py`` files the corpus may use, sorted."""
    found = []
    for folder, subfolders, files in os.walk(root, onerror=lambda _: None):
        subfolders[:] = [s for s in subfolders if s not in SKIPPED_FOLDERS]
        base = Path(folder).relative_to(root)
        found += [(base / name).as_posix() for name in files if name.endswith(".py")]
    return sorted(found)


def read_corpus(root: Path, train_bytes: int = TRAIN_BYTES,
                heldout_bytes: int = HELDOUT_BYTES) -> Corpus:
    """The corpus of the ``.py`` files under ``root`` (each part's files in reading order,
    the first FILE_BYTES of each); a SpecError if there is no such folder or it holds less
    text than either part needs."""
    if not root.is_dir():
        raise SpecError(f"dataset pysource reads the Python standard library's sources, "
                        f"but {root} is not a folder (a Python installed without them?)")
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    caps = {False: train_bytes, True: heldout_bytes}
    sizes = {False: 0, True: 0}
    for relative in reading_order(source_files(root)):
        held = is_heldout(relative)
        if sizes[held] >= caps[held]:
            if sizes[not held] >= caps[not held]:
                break
            continue
        try:
            with (root / relative).open("rb") as f:
                text = f.read(FILE_BYTES)
        except OSError:
            continue
        if text:
            parts[held].append(text)
            names[held].append(relative)
            sizes[held] += len(text)
    train, heldout = b"".join(parts[False]), b"".join(parts[True])
    if len(train) < train_bytes or len(heldout) < heldout_bytes:
        raise SpecError(f"dataset pysource: the Python standard library's sources at {root} "
                        f"hold {len(train)} training and {len(heldout)} held-out bytes of "
                        f".py files; it needs {train_bytes} and {heldout_bytes} (a Python "
                        "installed without its sources?)")
    return Corpus(train[:train_bytes], heldout[:heldout_bytes], tuple(names[False]),
                  tuple(names[True]))


def windows(text: bytes, context: int = CONTEXT) -> TensorDataset:
    """Non-overlapping windows of ``text``: x = text[i:i+T], y = text[i+1:i+T+1], int64,
    both views of one tensor."""
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    count = (len(tokens) - 1) // context
    x = tokens.as_strided((count, context), (context, 1), 0)
    y = tokens.as_strided((count, context), (context, 1), 1)
    return TensorDataset(x, y)


def split_of(corpus: Corpus, context: int = CONTEXT) -> DataSplit:
    return DataSplit(windows(corpus.train, context), windows(corpus.heldout, context),
                     in_features=context, num_classes=VOCAB)


@functools.cache  # read once per process, however many runs it creates
def pysource_corpus() -> Corpus:
    return read_corpus(stdlib_folder())


@functools.cache
def pysource() -> DataSplit:
    """The ``pysource`` dataset: ``pysource_corpus()`` in windows of CONTEXT bytes."""
    return split_of(pysource_corpus())


def unigram_loss(split: DataSplit) -> float:
    """Cross-entropy in nats per byte of the training bytes' frequencies, add-one smoothed,
    on the held-out bytes: what a model that ignores context reaches."""
    loss = frequency_loss(split.train, split.test, split.num_classes, batch_size=4096)
    if loss is None:
        raise SpecError("unigram_loss needs byte targets (integers from 0 to 255)")
    return loss
