"""The parameter layout: how named tensors map onto one flat float32 vector."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.size)


@dataclass(frozen=True)
class ParamLayout:
    """Named tensors laid end to end in a flat vector, in model order."""

    tensors: tuple[Tensor, ...]

    @classmethod
    def from_shapes(cls, named_shapes: list[tuple[str, tuple[int, ...]]]) -> ParamLayout:
        tensors, offset = [], 0
        for name, shape in named_shapes:
            tensor = Tensor(name, tuple(int(d) for d in shape), offset)
            tensors.append(tensor)
            offset += tensor.size
        return cls(tuple(tensors))

    @property
    def size(self) -> int:
        """Total number of float32 elements."""
        last = self.tensors[-1] if self.tensors else None
        return last.offset + last.size if last else 0

    @property
    def layout_id(self) -> str:
        """A short digest of names and shapes: two layouts match iff their ids do."""
        canonical = json.dumps([[t.name, list(t.shape)] for t in self.tensors])
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(
            {"layout_id": self.layout_id,
             "tensors": [{"name": t.name, "shape": list(t.shape), "offset": t.offset}
                         for t in self.tensors]}
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ParamLayout:
        data = json.loads(text)
        return cls.from_shapes([(t["name"], tuple(t["shape"])) for t in data["tensors"]])
