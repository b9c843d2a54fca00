"""Valid gradient messages for benchmark producers, made without a model.

A producer stands in for a worker: it publishes the same gradient over and over, computed
on whatever version the head names. Packing the payload once and only the header per
version keeps the producer's cost to what any publisher pays (one copy of the bytes into
the message), not a fresh gradient's encoding each time.
"""

from __future__ import annotations

import numpy as np

from gemq.wire import codec

SAMPLES, LOSS = 64, 0.5


class Messages:
    """Messages byte-identical to ``codec.encode`` of one fixed gradient, by version."""

    def __init__(self, run_id: str, worker_id: str, layout_id: str, gradient: np.ndarray,
                 dtype: str = "float32") -> None:
        self._payload = codec.wire_elements(gradient, dtype).view(np.uint8)
        self._header: list[object] = [codec.FORMAT_VERSION, run_id, worker_id, 0, SAMPLES,
                                      LOSS, dtype, layout_id]
        self._version, self._message = -1, memoryview(b"")
        assert self.at(0) == codec.encode(run_id=run_id, worker_id=worker_id, param_version=0,
                                          samples=SAMPLES, loss=LOSS, layout_id=layout_id,
                                          gradient=gradient, dtype=dtype)

    def at(self, version: int) -> memoryview:
        """The message of a gradient computed on ``version`` (re-made only when it moved)."""
        if version != self._version:
            self._message = memoryview(b"")  # the old one goes before the new one is made
            self._header[3] = version
            message, payload = codec.frame(self._header, self._payload.size)
            payload[:] = self._payload
            self._message = message.data.toreadonly()
            self._version = version
        return self._message
