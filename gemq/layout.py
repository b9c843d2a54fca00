"""The state layout: how a model's named tensors map onto one flat float32 vector.

Parameters come first, then the model's persistent buffers (BatchNorm's running mean,
variance and batch count, and any other): the flat vector is the run's whole published
state. The aggregator applies its rule to the parameters and adds the workers' changes to
the buffers (gemq/aggregation/rules.py). Buffers of other dtypes travel as float32 and go
back to their own dtype when loaded (integers exactly up to 2**24).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

PARAM, BUFFER = "param", "buffer"
#: Buffer dtypes the flat float32 vector can carry (by torch's names, without "torch.").
BUFFER_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
                 "int8", "uint8", "bool")


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int
    kind: str = PARAM
    dtype: str = "float32"

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
                    buffers: Sequence[tuple[str, tuple[int, ...], str]] = ()) -> ParamLayout:
        """``named_shapes``: the parameters; ``buffers``: (name, shape, dtype) after them."""
        entries = [(name, shape, PARAM, "float32") for name, shape in named_shapes]
        entries += [(name, shape, BUFFER, dtype) for name, shape, dtype in buffers]
        tensors, offset = [], 0
        for name, shape, kind, dtype in entries:
            tensor = Tensor(name, tuple(int(d) for d in shape), offset, kind, dtype)
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

    @property
    def layout_id(self) -> str:
        """A short digest of names, shapes, kinds and dtypes: two layouts match iff their
        ids do. (A model without buffers keeps the id it had before buffers existed.)"""
        canonical = json.dumps([[t.name, list(t.shape)] if t.kind == PARAM
                                else [t.name, list(t.shape), t.kind, t.dtype]
                                for t in self.tensors])
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(
            {"layout_id": self.layout_id,
             "tensors": [{"name": t.name, "shape": list(t.shape), "offset": t.offset,
                          "kind": t.kind, "dtype": t.dtype} for t in self.tensors]}
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ParamLayout:
        data = json.loads(text)
        entries = data["tensors"]
        return cls.from_shapes(
            [(t["name"], tuple(t["shape"])) for t in entries if t.get("kind", PARAM) == PARAM],
            [(t["name"], tuple(t["shape"]), t.get("dtype", "float32")) for t in entries
             if t.get("kind") == BUFFER])
