"""gemq: asynchronous PyTorch training over Redis Streams with Gradient Energy Matching.

``gemq.train(...)`` trains locally (gemq.local.train) and returns a ``gemq.RunSummary``
(gemq.summary). ``import gemq`` itself stays light: torch is imported when ``train`` is
first looked up, so the aggregator never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["RunSummary", "__version__", "train"]

if TYPE_CHECKING:
    from gemq.local import train
    from gemq.summary import RunSummary


def __getattr__(name: str) -> Any:
    if name == "train":
        from gemq.local import train

        return train
    if name == "RunSummary":
        from gemq.summary import RunSummary

        return RunSummary
    raise AttributeError(f"module 'gemq' has no attribute {name!r}")
