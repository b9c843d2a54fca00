"""A run's curves as TensorBoard scalars (the optional ``tensorboard`` extra): every plotted
column of gemq.records.curves, with the update count as the step and the commit's wall time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemq.errors import ConfigError
from gemq.records.curves import PI_PREFIX, Row, plotted

#: pi:<tensor> columns become pi/<tensor> tags: TensorBoard groups its charts by the part
#: before the first slash.
PI_TAG_PREFIX = "pi/"


def require_tensorboard() -> None:
    """Fail in one line, before a run starts, when the tensorboard extra is missing."""
    _summary_writer()


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError("tensorboard", "needs the tensorboard package: "
                                         "pip install 'gemq[tensorboard]'") from e
    return SummaryWriter


def tag_of(column: str) -> str:
    return PI_TAG_PREFIX + column.removeprefix(PI_PREFIX) if column.startswith(PI_PREFIX) \
        else column


class TensorBoardSink:
    """Writes rows of ``header`` as scalars to an event file in ``log_dir``."""

    def __init__(self, log_dir: Path, header: Sequence[str]) -> None:
        self._writer = _summary_writer()(log_dir=str(log_dir))
        self._tags = [(column, tag_of(column)) for column in plotted(header)]

    def write(self, rows: Sequence[Row]) -> None:
        for row in rows:
            step, t_ms = row["updates"], row["t_ms"]
            if not isinstance(step, int):
                continue
            walltime = t_ms / 1000 if isinstance(t_ms, int) else None
            for column, tag in self._tags:
                value = row.get(column)
                if isinstance(value, int | float):
                    self._writer.add_scalar(tag, value, step, walltime=walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
