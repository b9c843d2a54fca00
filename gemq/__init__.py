"""gemq: asynchronous PyTorch training over Redis Streams with Gradient Energy Matching.

``gemq.train(...)`` trains locally (gemq.running.local.train) and returns a
``gemq.RunSummary`` (gemq.records.summary); ``gemq.RunConfig`` (gemq.config) is a run's
configuration and ``gemq.models`` the built-in models. ``import gemq`` itself stays light:
torch is imported when ``train`` is first looked up, so the aggregator never loads it.

The package is a house of wings, one subpackage per subsystem, each with a docstring that
maps its modules:

| wing | what it holds |
|---|---|
| ``gemq.wire`` | the gradient message: encoding, decoding, validation |
| ``gemq.state`` | a run's state in Redis: keys, the ``RunStore`` façade, scripts, retention |
| ``gemq.aggregation`` | the aggregator: leadership, commit windows, rejections, rules, kernel |
| ``gemq.training`` | the worker: models, data, losses, the flat-vector step |
| ``gemq.records`` | curves, summary, progress, export: what a run leaves to read |
| ``gemq.running`` | one machine: a private Redis, run creation, ``gemq run`` |
| ``gemq.sim`` | research mode: n workers simulated in one process, no Redis |

and the base, here at the top, which every wing may use:

| module | one job |
|---|---|
| ``errors`` | the one exception hierarchy |
| ``ids`` | what a run id and a worker id may be |
| ``jit`` | numba's compiler, set up once for every compiled loop |
| ``config`` | ``RunConfig``: one validated configuration shared by every process of a run |
| ``layout`` | how a model's named tensors map onto one flat float32 vector |
| ``shards`` | a run's flat state cut into contiguous ranges |
| ``logs`` | how every process logs |
| ``process`` | what every process entry point does first |
| ``threads`` | long-running tasks of one process, one shutdown event |
| ``telemetry`` | what the aggregator and workers report about their own work |
| ``cliargs`` | the argparse pieces every command shares |
| ``configfile`` | ``--config FILE``: flags from TOML, and the config.toml a run leaves |
| ``ports`` | a port about to be listened on: taken is one clear error |

and the top, which nothing of the library imports:

| module | one job |
|---|---|
| ``cli``, ``__main__`` | the ``gemq`` command line, which may import anything |
| ``models`` | the built-in models under their public name (gemq.training.models) |

Imports point down, never up or sideways: the base imports no wing; wire imports the base;
state imports wire; aggregation, training and records import state and wire but not one
another; running and sim import those; the services (gemq.services) and the command line
import everything. tests/test_packaging.py holds the house to this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["RunConfig", "RunSummary", "__version__", "train"]

if TYPE_CHECKING:
    from gemq.config import RunConfig
    from gemq.records.summary import RunSummary
    from gemq.running.local import train


def __getattr__(name: str) -> Any:
    if name == "train":
        from gemq.running.local import train

        return train
    if name == "RunSummary":
        from gemq.records.summary import RunSummary

        return RunSummary
    if name == "RunConfig":
        from gemq.config import RunConfig

        return RunConfig
    raise AttributeError(f"module 'gemq' has no attribute {name!r}")
