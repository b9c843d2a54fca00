"""The state layout: how a model's named tensors map onto one flat float32 vector.

Parameters come first, then the model's persistent buffers (BatchNorm's running mean,
variance and batch count, and any other): the flat vector is the run's whole published
state. The aggregator applies its rule to the parameters and the workers' changes to the
buffers (gemq/aggregation/rules.py): a buffer that is an exponential moving average records
its ``momentum`` here (BatchNorm's running mean and variance: the module's momentum), so
that a change computed on a stale copy is re-applied to the run's current value; any other
buffer's change (momentum 0) is added as it is. Buffers of other dtypes travel as float32
and go back to their own dtype when loaded (integers exactly up to 2**24).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PARAM, BUFFER = "param", "buffer"
#: Buffer dtypes the flat float32 vector can carry (by torch's names, without "torch.").
BUFFER_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
                 "int8", "uint8", "bool")
#: A buffer for ParamLayout.from_shapes: (name, shape, dtype), or with its momentum.
BufferEntry = tuple[str, tuple[int, ...], str] | tuple[str, tuple[int, ...], str, float]


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int
    kind: str = PARAM
    dtype: str = "float32"
    #: A buffer's moving-average momentum m (v = (1 - m) s + m b per step); 0 for the
    #: parameters and for a buffer whose change is added as it is.
    momentum: float = 0.0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.size)


@dataclass(frozen=True)
class ParamLayout:
    """Named tensors laid end to end in a flat vector: parameters, then buffers."""

    tensors: tuple[Tensor, ...]

    @classmethod
    def from_shapes(cls, named_shapes: Sequence[tuple[str, tuple[int, ...]]],
                    buffers: Sequence[BufferEntry] = ()) -> ParamLayout:
        """``named_shapes``: the parameters; ``buffers``: (name, shape, dtype) or (name,
        shape, dtype, momentum) after them (momentum 0 when left out)."""
        entries = [(name, shape, PARAM, "float32", 0.0) for name, shape in named_shapes]
        entries += [(b[0], b[1], BUFFER, b[2], _momentum(b[0], b[3] if len(b) > 3 else 0.0))
                    for b in buffers]
        tensors, offset = [], 0
        for name, shape, kind, dtype, momentum in entries:
            tensor = Tensor(name, tuple(int(d) for d in shape), offset, kind, dtype, momentum)
            tensors.append(tensor)
            offset += tensor.size
        return cls(tuple(tensors))

    @property
    def size(self) -> int:
        """Total number of float32 elements: parameters and buffers."""
        last = self.tensors[-1] if self.tensors else None
        return last.offset + last.size if last else 0

    @property
    def params(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.kind == PARAM)

    @property
    def buffers(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.kind == BUFFER)

    @property
    def param_size(self) -> int:
        """Elements of the parameters: the first ``param_size`` of the flat vector."""
        return sum(t.size for t in self.params)

    def buffer_momenta(self, start: int = 0, stop: int | None = None) -> np.ndarray | None:
        """Each element's momentum (float32) in elements [start, stop) of the buffers' part
        of the flat vector (offsets counted from ``param_size``; all of it by default);
        None when all are 0."""
        if stop is None:
            stop = self.size - self.param_size
        momenta = np.zeros(max(stop - start, 0), np.float32)
        base = self.param_size
        for t in self.buffers:
            low, high = max(t.offset - base, start), min(t.offset - base + t.size, stop)
            if t.momentum and low < high:
                momenta[low - start:high - start] = t.momentum
        return momenta if momenta.any() else None

    @property
    def layout_id(self) -> str:
        """A short digest of names, shapes, kinds and dtypes: two layouts match iff their
        ids do. (A model without buffers keeps the id it had before buffers existed.)

        A buffer's momentum is not part of it: the id says what each element of the vector
        is, which workers, shards and saved models must agree on; the momentum says how the
        aggregator applies a change, and comes from the run's own stored layout. Layouts
        written before momenta were recorded keep their ids (and add every change).
        """
        canonical = json.dumps([[t.name, list(t.shape)] if t.kind == PARAM
                                else [t.name, list(t.shape), t.kind, t.dtype]
                                for t in self.tensors])
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(
            {"layout_id": self.layout_id,
             "tensors": [{"name": t.name, "shape": list(t.shape), "offset": t.offset,
                          "kind": t.kind, "dtype": t.dtype,
                          **({"momentum": t.momentum} if t.kind == BUFFER else {})}
                         for t in self.tensors]}
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ParamLayout:
        data = json.loads(text)
        entries = data["tensors"]
        return cls.from_shapes(
            [(t["name"], tuple(t["shape"])) for t in entries if t.get("kind", PARAM) == PARAM],
            [(t["name"], tuple(t["shape"]), t.get("dtype", "float32"),
              float(t.get("momentum", 0.0))) for t in entries if t.get("kind") == BUFFER])


def _momentum(name: str, value: float) -> float:
    """A buffer's moving-average momentum, checked: a number in [0, 1]."""
    momentum = float(value)
    if not 0.0 <= momentum <= 1.0:  # NaN fails too
        raise ValueError(f"buffer {name!r}: momentum {value!r} is not in [0, 1]")
    return momentum
