"""Run configuration: one validated dataclass shared by every process of a run."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from gemq.errors import ConfigError
from gemq.keys import is_valid_run_id

ALGORITHMS = ("gem", "downpour", "adaptive", "dcasgd")
PROXIES = ("local", "global")
WIRE_DTYPES = ("float32", "float16", "bfloat16")
#: DC-ASGD's lambda when the caller does not choose one (see docs/results/README.md).
DCASGD_LAMBDA = 1.0


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. Units are given where a field has one."""

    run_id: str
    algo: str = "gem"
    lr: float = 0.05
    momentum: float = 0.9
    kappa: float = 1.0
    pi_max: float = 5.0
    eps: float = 1e-12
    proxy: str = "local"
    batch_size: int = 64
    #: Gradient updates the aggregator applies before the run is finished.
    budget_updates: int = 1000
    model: str = "cnn"
    dataset: str = "mnist5k"
    seed: int = 0
    #: A gradient computed on parameters more than this many updates old is rejected.
    max_staleness: int = 512
    #: Parameter snapshots kept (in Redis and in the aggregator) to compute theta - s.
    history: int = 64
    #: Workers wait while the gradient stream holds more entries than this.
    max_pending: int = 64
    #: Aggregator reads at most this many gradients per batch (one commit per batch).
    read_batch: int = 32
    #: A worker silent this long (seconds) loses its GEM state.
    worker_timeout_s: float = 60.0
    #: Encoded gradient messages larger than this are refused; 0 means "payload + 64 KiB".
    max_message_bytes: int = 0
    wire_dtype: str = "float32"
    #: Publication policy: the aggregator publishes new parameters (and commits) once at
    #: least this many updates were applied since the last publication...
    publish_every: int = 1
    #: ...and at least this many milliseconds have passed since it (0: no wait).
    publish_interval_ms: int = 0

    def __post_init__(self) -> None:
        for check in _CHECKS:
            check(self)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        if "run_id" not in data:
            raise ConfigError("run_id", "is required")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(unknown[0], "unknown setting")
        return cls(**{name: _coerce(known[name], value) for name, value in data.items()})


def _coerce(field: dataclasses.Field[Any], value: Any) -> Any:
    kind = {"int": int, "float": float, "str": str}[str(field.type)]
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(field.name, f"must be an integer, got {value!r}")
    if isinstance(value, bool) or (kind is not str and isinstance(value, str | bytes)):
        raise ConfigError(field.name, f"must be a number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ConfigError(field.name, f"must be a string, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(field.name, f"cannot read {value!r} as {kind.__name__}") from e


def _in_range(name: str, low: float, high: float, *, low_open: bool = False,
              high_open: bool = False) -> Any:
    def check(config: RunConfig) -> None:
        value = getattr(config, name)
        if not math.isfinite(value):
            raise ConfigError(name, f"must be finite, got {value}")
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if too_low or too_high:
            left, right = "(" if low_open else "[", ")" if high_open else "]"
            raise ConfigError(name, f"must be in {left}{low:g}, {high:g}{right}, got {value:g}")
    return check


def _one_of(name: str, choices: tuple[str, ...]) -> Any:
    def check(config: RunConfig) -> None:
        if getattr(config, name) not in choices:
            raise ConfigError(name, f"must be one of {', '.join(choices)}; "
                                    f"got {getattr(config, name)!r}")
    return check


def _check_run_id(config: RunConfig) -> None:
    if not is_valid_run_id(config.run_id):
        raise ConfigError("run_id", "1-64 characters of letters, digits, '_', '.', '-', "
                                    f"starting with a letter or digit; got {config.run_id!r}")


def _check_publish_every(config: RunConfig) -> None:
    # An open window's gradients stay in the stream, and workers stop at max_pending.
    if config.publish_every > max(1, config.max_pending // 2):
        raise ConfigError("publish_every", f"must be at most max_pending / 2 "
                                           f"({max(1, config.max_pending // 2)}), got "
                                           f"{config.publish_every}: workers would wait for "
                                           "a publication that cannot come")


def _check_specs(config: RunConfig) -> None:
    for name in ("model", "dataset"):
        if not getattr(config, name).strip():
            raise ConfigError(name, "must not be empty")


_CHECKS = (
    _check_run_id,
    _check_specs,
    _one_of("algo", ALGORITHMS),
    _one_of("proxy", PROXIES),
    _one_of("wire_dtype", WIRE_DTYPES),
    _in_range("lr", 0, 10, low_open=True),
    _in_range("momentum", 0, 1, high_open=True),
    _in_range("kappa", 0, 100, low_open=True),
    _in_range("pi_max", 0, 1e6, low_open=True),
    _in_range("eps", 0, 1, low_open=True),
    _in_range("batch_size", 1, 65536),
    _in_range("budget_updates", 1, 10**9),
    _in_range("seed", 0, 2**32 - 1),
    _in_range("max_staleness", 0, 10**6),
    _in_range("history", 1, 4096),
    _in_range("max_pending", 1, 10**6),
    _in_range("read_batch", 1, 4096),
    _in_range("worker_timeout_s", 0, 10**6, low_open=True),
    _in_range("max_message_bytes", 0, 2**31),
    _in_range("publish_every", 1, 4096),
    _in_range("publish_interval_ms", 0, 60_000),
    _check_publish_every,
)
