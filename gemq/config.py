"""Run configuration: one validated dataclass shared by every process of a run.

This module is the one home of every run setting's default, range, choices and help text.
The ``gemq`` flags (gemq/cliargs.py), the API's request schema (gemq.services.api.schemas)
and the dashboard's start form (``GET /api/settings``) are all built from ``USER_SETTINGS``,
and every one of them turns what the user gave into a ``RunConfig`` through ``make_config``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemq.errors import ConfigError
from gemq.ids import is_valid_run_id

ALGORITHMS = ("gem", "downpour", "adaptive", "dcasgd")
PROXIES = ("local", "global")
#: The proxy's optimizer: the paper's momentum SGD, or Adam (gemq/aggregation/rules.py).
OPTIMIZERS = ("momentum", "adam")
#: The learning rate when the user leaves it to gemq, by optimizer: the paper's for momentum
#: SGD; for Adam the usual 1e-3 (Kingma & Ba), which its per-element step size is close to.
DEFAULT_LR = {"momentum": 0.05, "adam": 1e-3}
#: Parameter-sized float32 vectors in one worker's proxy state: momentum SGD's moment, or
#: Adam's two (and its step count: ``proxy_state_bytes``).
PROXY_STATE_VECTORS = {"momentum": 1, "adam": 2}
#: Adam's beta2 and epsilon when not given: torch.optim.Adam's defaults.
ADAM_BETA2 = 0.999
ADAM_EPS = 1e-8
WIRE_DTYPES = ("float32", "float16", "bfloat16")
AMP_MODES = ("off", "on", "bfloat16", "float16")
#: DC-ASGD's lambda when the caller does not choose one (see docs/results/README.md).
DCASGD_LAMBDA = 1.0
#: The budget when the user gives neither epochs nor steps.
DEFAULT_EPOCHS = 10.0
#: Groups of user settings: how the CLI's --help, the API docs and the form arrange them.
TRAINING, BUDGET, TRANSPORT, LIMITS = "training", "budget", "transport", "limits"
#: How workers compute (not simulated by gemq simulate).
COMPUTE = "compute"
#: The value of a setting that gemq chooses from the model, the workers and the Redis when
#: the run is created (gemq/running/sizing.py); the value a user leaves such a setting at.
AUTO = "auto"


@dataclass(frozen=True)
class Setting:
    """One setting a user may give: its type, default, range or choices, and help."""

    name: str
    kind: type
    default: Any
    help: str
    group: str = TRAINING
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    max_length: int | None = None
    #: gemq chooses the value when the run is created unless the user gives one (AUTO).
    auto: bool = False

    def check(self, value: Any) -> None:
        """Raise ConfigError naming the setting unless ``value`` is allowed."""
        if self.auto and value == AUTO:
            return
        if self.choices is not None and value not in self.choices:
            raise ConfigError(self.name, f"must be one of {', '.join(self.choices)}; "
                                         f"got {value!r}")
        if self.kind is str:
            if not value.strip():
                raise ConfigError(self.name, "must not be empty")
            if self.max_length is not None and len(value) > self.max_length:
                raise ConfigError(self.name, f"at most {self.max_length} characters")
        if self.low is not None and self.high is not None:
            self._check_range(value)

    def _check_range(self, value: float) -> None:
        assert self.low is not None and self.high is not None
        if not math.isfinite(value):
            raise ConfigError(self.name, f"must be finite, got {value}")
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = value >= self.high if self.high_open else value > self.high
        if too_low or too_high:
            raise ConfigError(self.name, f"must be in {self.range_text()}, got {value:g}")

    @property
    def offered_choices(self) -> tuple[str, ...] | None:
        """The choices a user is offered: AUTO first where gemq may choose."""
        if self.choices is None:
            return None
        return (AUTO, *self.choices) if self.auto else self.choices

    def range_text(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{left}{self.low:g}, {self.high:g}{right}"

    def as_dict(self) -> dict[str, Any]:
        """The JSON description the dashboard builds its form from."""
        kind = {int: "integer", float: "number", str: "string"}[self.kind]
        choices = self.offered_choices
        return {"name": self.name, "type": kind, "default": self.default, "help": self.help,
                "group": self.group, "choices": list(choices) if choices else None,
                "auto": self.auto,
                "minimum": self.low, "maximum": self.high,
                "exclusive_minimum": self.low_open, "exclusive_maximum": self.high_open,
                "max_length": self.max_length}


_META = "gemq"


def _setting(default: Any, help: str, *, user: bool = True, **limits: Any) -> Any:
    """A RunConfig field with its Setting (``user``: offered on the CLI, API and form)."""
    return field(default=default, metadata={_META: (help, user, limits)})


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. Units are given where a field has one."""

    run_id: str
    algo: str = _setting("gem", "aggregation rule: gem, downpour (plain asynchronous SGD), "
                         "adaptive (delta / (staleness + 1)), dcasgd (delay compensation)",
                         choices=ALGORITHMS)
    proxy: str = _setting("local", "GEM's proxy moment: each worker's own (local, the "
                          "paper) or one over all updates (global)", choices=PROXIES)
    optimizer: str = _setting("momentum", "the proxy's optimizer: momentum (SGD with "
                              "momentum, the paper's) or adam (Adam; --momentum is its beta1)",
                              choices=OPTIMIZERS)
    lr: float = _setting(DEFAULT_LR["momentum"], "learning rate eta of the proxy; auto: "
                         "0.05 for momentum, 0.001 for adam", low=0, high=10, low_open=True,
                         auto=True)
    momentum: float = _setting(0.9, "momentum mu of the proxy (Adam's beta1)", low=0, high=1,
                               high_open=True)
    beta2: float = _setting(ADAM_BETA2, "Adam's beta2 (optimizer adam)", low=0, high=1,
                            high_open=True)
    adam_eps: float = _setting(ADAM_EPS, "Adam's epsilon (optimizer adam)", user=False,
                               low=0, high=1, low_open=True)
    kappa: float = _setting(1.0, "GEM's proxy amplification", low=0, high=100, low_open=True)
    pi_max: float = _setting(5.0, "GEM's clip of pi", low=0, high=1e6, low_open=True)
    eps: float = _setting(1e-12, "GEM's epsilon in pi's denominator", user=False,
                          low=0, high=1, low_open=True)
    #: Minibatch size of one worker step.
    batch_size: int = _setting(64, "minibatch size of one worker step", low=1, high=65536)
    #: Gradient updates the aggregator applies before the run is finished.
    budget_updates: int = _setting(1000, "updates to apply", user=False, low=1, high=10**9)
    model: str = _setting("cnn", "cnn (the GEM paper's), resnet (residual, BatchNorm), mlp, "
                          "logreg, transformer (byte-level text: --dataset pysource) or "
                          "package.module:factory",
                          max_length=200)
    dataset: str = _setting("mnist5k", "mnist5k, digits, pysource (the Python standard "
                            "library's source, as bytes), mnist-idx:DIR or "
                            "package.module:factory", max_length=500)
    loss: str = _setting("cross_entropy", "cross_entropy (the model outputs logits or "
                         "log-probabilities), nll (log-probabilities) or "
                         "package.module:function(output, target)", max_length=200)
    amp: str = _setting("off", "workers' mixed precision: on (bfloat16 on CPU; bfloat16 or "
                        "float16 on CUDA), bfloat16, float16 or off; gradients still travel "
                        "in the wire dtype", group=COMPUTE, choices=AMP_MODES)
    seed: int = _setting(0, "seed of the initial parameters and the minibatch order",
                         low=0, high=2**32 - 1)
    #: A worker evaluates the parameters it loads on held-out samples whenever this many
    #: more updates were applied (gemq/training/heldout.py); the metrics carry the result.
    eval_every: int = _setting(200, "evaluate the parameters on held-out samples (the first "
                               "512 of the test set) every this many updates; 0: never",
                               group=COMPUTE, low=0, high=10**9)
    #: A gradient computed on parameters more than this many updates old is rejected.
    max_staleness: int = _setting(512, "gradients staler than this many updates are "
                                  "rejected", low=0, high=10**6)
    #: Parameter snapshots kept (in Redis and in the aggregator) to compute theta - s are
    #: bounded by bytes, per shard; the staleness a run accepts is what they cover, up to
    #: max_staleness (gemq/aggregation/snapshots.py: kept_versions).
    snapshot_budget_mb: int = _setting(64, "megabytes of parameter snapshots kept per "
                                       "shard, in Redis and in its aggregator: gradients "
                                       "older than the snapshots kept are rejected; auto: "
                                       "64, or more to keep every gradient in flight",
                                       group=LIMITS, low=1, high=10**6, auto=True)
    #: At most this many snapshots as well (0: no count beyond the budget's).
    history: int = _setting(0, "snapshots kept at most", user=False, low=0, high=10**6)
    #: Workers wait while the gradient stream holds more entries than this.
    max_pending: int = _setting(64, "workers wait while the stream holds more gradients "
                                "than this; auto: as many as 64 MB of snapshots cover "
                                "beside the workers, 4 to 64 (fewer where the Redis' "
                                "memory needs it)", group=TRANSPORT, low=1,
                                high=10**6, auto=True)
    #: The parameters are split into this many shards, each with its own aggregator.
    shards: int = _setting(1, "split the parameters into this many shards, each with its "
                           "own gradient stream and aggregator (on one Redis or a Redis "
                           "Cluster); auto: the fewest that hold the model (one per "
                           "master of --local-cluster)", group=TRANSPORT, low=1, high=256,
                           auto=True)
    #: Aggregator reads at most this many gradients per batch.
    read_batch: int = _setting(32, "gradients per read", user=False, low=1, high=4096)
    #: A worker silent this long (seconds) loses its GEM state.
    worker_timeout_s: float = _setting(60.0, "seconds", user=False, low=0, high=10**6,
                                       low_open=True)
    #: Encoded gradient messages larger than this are refused; 0 means "payload + 64 KiB".
    max_message_bytes: int = _setting(0, "bytes", user=False, low=0, high=2**31)
    wire_dtype: str = _setting("float32", "gradient payloads: float32, or half the bytes as "
                               "bfloat16 (cheap to convert) or float16; auto: bfloat16 from "
                               "32 MB of parameters, float32 below", group=TRANSPORT,
                               choices=WIRE_DTYPES, auto=True)
    #: Publication policy: the aggregator publishes new parameters (and commits) once at
    #: least this many updates were applied since the last publication...
    publish_every: int = _setting(1, "publish parameters once this many updates were "
                                  "applied since the last publication; auto: 2 from 32 MB "
                                  "of parameters, 1 below", group=TRANSPORT, low=1,
                                  high=4096, auto=True)
    #: ...and at least this many milliseconds have passed since it (0: no wait).
    publish_interval_ms: int = _setting(0, "...and this many ms have passed since it "
                                        "(0: no wait)", group=TRANSPORT, low=0, high=60_000)
    #: The aggregator checkpoints the GEM moments into Redis with a commit whenever this
    #: share of its time has passed since the last one's cost; a new leader restores them.
    checkpoint_overhead: float = _setting(0.05, "share of the aggregator's time spent "
                                          "checkpointing GEM moments for a restart (0: "
                                          "never)", group=TRANSPORT, low=0, high=1)
    #: A run that cannot make progress fails instead of spinning: after this many gradients
    #: in a row were rejected...
    max_rejected_in_a_row: int = _setting(1000, "the run fails after this many gradients in "
                                          "a row were rejected", group=LIMITS,
                                          low=1, high=10**9)
    #: ...or once no update was applied for this long (s) while gradients were rejected or
    #: workers could not publish. A run with no worker at all simply waits.
    stall_timeout_s: float = _setting(120.0, "the run fails when no update was applied for "
                                      "this many seconds while gradients were rejected or "
                                      "could not be published; gemq run waits a Redis "
                                      "outage this long", group=LIMITS,
                                      low=1, high=10**6)

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        for setting in CONFIG_SETTINGS:
            setting.check(getattr(self, setting.name))
        _check_publish_every(self)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """A config from stored or given fields (values are type-checked, not guessed)."""
        if "run_id" not in data:
            raise ConfigError("run_id", "is required")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ConfigError(unknown[0], "unknown setting")
        return cls(**{name: coerce(_FIELDS[name], value) for name, value in data.items()})


_FIELDS: dict[str, Setting] = {}


def _settings_of_fields() -> tuple[tuple[Setting, ...], tuple[Setting, ...]]:
    every, offered = [], []
    for f in dataclasses.fields(RunConfig):
        if _META not in f.metadata:
            continue
        help_text, user, limits = f.metadata[_META]
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        # A RunConfig holds the values chosen: only what users give may be AUTO.
        every.append(Setting(f.name, kind, f.default, help_text, **{**limits, "auto": False}))
        if user:
            auto = limits.get("auto", False)
            offered.append(Setting(f.name, kind, AUTO if auto else f.default, help_text,
                                   **limits))
    return tuple(every), tuple(offered)


#: Every RunConfig field with a default, and those a user sets (CLI, API, dashboard).
CONFIG_SETTINGS, _OFFERED = _settings_of_fields()
_FIELDS.update({s.name: s for s in CONFIG_SETTINGS})
_FIELDS["run_id"] = Setting("run_id", str, None, "run id")
#: The budget, given as one of these (not both); stored as ``budget_updates``.
BUDGET_SETTINGS = (
    Setting("epochs", float, None, f"passes over the training set, summed over workers "
            f"(default {DEFAULT_EPOCHS:g})", group=BUDGET, low=0, high=100_000, low_open=True),
    Setting("steps", int, None, "gradient updates to apply", group=BUDGET, low=1, high=10**9),
)
#: What users set, in the order the CLI and the form show it.
USER_SETTINGS: tuple[Setting, ...] = (*_OFFERED, *BUDGET_SETTINGS)


def coerce(setting: Setting, value: Any) -> Any:
    """``value`` as the setting's type; a number given as text, or a bool, is refused."""
    kind = setting.kind
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(setting.name, f"must be an integer, got {value!r}")
    if isinstance(value, bool) or (kind is not str and isinstance(value, str | bytes)):
        raise ConfigError(setting.name, f"must be a number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ConfigError(setting.name, f"must be a string, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(setting.name, f"cannot read {value!r} as {kind.__name__}") from e


def proxy_state_bytes(config: RunConfig, size: int) -> int:
    """Bytes of one worker's proxy state over ``size`` parameters: a checkpointed moment's
    value in Redis (gemq.aggregation.rules.Proxy.state_size)."""
    return 4 * (PROXY_STATE_VECTORS[config.optimizer] * size + (config.optimizer == "adam"))


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def budget_updates(epochs: float, train_samples: int, batch_size: int) -> int:
    """Updates needed for ``epochs`` passes over the training set, summed over workers."""
    return max(1, math.ceil(epochs * train_samples / batch_size))


#: Fewer updates than this per worker, and a run is over before each worker has sent more
#: than a handful of gradients: worth a note when the budget came from epochs.
FEW_UPDATES_PER_WORKER = 10


def short_budget_note(config: RunConfig, workers: int) -> str | None:
    """A note for a budget of only a few updates per worker, or None.

    Epochs count passes over the training set by all workers together, so
    ``gemq simulate --workers 100 --epochs 1`` on 4,000 samples is 63 updates in all;
    users who read an epoch as each worker's pass are surprised by the short run.
    """
    per_worker = config.budget_updates / workers
    if workers < 2 or per_worker >= FEW_UPDATES_PER_WORKER:
        return None
    return (f"note: {config.budget_updates:,} updates in all, {per_worker:.1f} per worker for "
            f"{workers} workers (epochs count passes over the training set by all workers "
            "together); for a longer run raise --epochs or give --steps")


def make_config(settings: Mapping[str, Any], *, train_samples: int) -> RunConfig:
    """The one way user settings become a validated RunConfig.

    ``settings``: RunConfig fields and the budget as ``epochs`` or ``steps`` (not both;
    neither: DEFAULT_EPOCHS); a value of None means the default; no ``run_id``: a new one.
    A setting left to gemq (``left_to_gemq``) takes RunConfig's default here, which
    gemq.running.sizing replaces once the model and the Redis are known; a learning rate
    left to gemq is the optimizer's (DEFAULT_LR).
    ``train_samples`` (the training set's size) turns epochs into updates.
    """
    # RunConfig's defaults until the run is sized; the learning rate once the optimizer is.
    left = {*left_to_gemq(settings), *(n for n in RESOLVED_BY_CONFIG if _is_left(settings, n))}
    given = {name: value for name, value in settings.items()
             if value is not None and name not in left}
    budget = {s.name: coerce(s, given.pop(s.name)) for s in BUDGET_SETTINGS
              if s.name in given}
    for setting in BUDGET_SETTINGS:
        if setting.name in budget:
            setting.check(budget[setting.name])
    if len(budget) > 1:
        raise ConfigError("steps", "give epochs or steps, not both")
    given.setdefault("run_id", new_run_id())
    config = RunConfig.from_dict(given)
    if "lr" in left:
        config = config.replace(lr=DEFAULT_LR[config.optimizer])
    if not budget and "budget_updates" in given:
        return config  # a caller that counts in updates already
    steps = budget.get("steps") or budget_updates(budget.get("epochs", DEFAULT_EPOCHS),
                                                  train_samples, config.batch_size)
    return config.replace(budget_updates=steps)


#: The workers a run is sized for where they are not known when it is created (gemq create,
#: the API: workers join later), as gemq run starts by default.
PLANNED_WORKERS = 4
#: Settings whose AUTO ``make_config`` resolves at once, from other settings alone.
RESOLVED_BY_CONFIG = ("lr",)
#: The settings gemq may choose when a run is created (gemq/running/sizing.py).
AUTO_SETTINGS = tuple(s.name for s in USER_SETTINGS
                      if s.auto and s.name not in RESOLVED_BY_CONFIG)


def _is_left(settings: Mapping[str, Any], name: str) -> bool:
    return settings.get(name, AUTO) in (None, AUTO)


def left_to_gemq(settings: Mapping[str, Any]) -> tuple[str, ...]:
    """The AUTO_SETTINGS that ``settings`` leaves to gemq: not given, None or AUTO."""
    return tuple(name for name in AUTO_SETTINGS if _is_left(settings, name))


def validate_settings(settings: Mapping[str, Any]) -> None:
    """Raise ConfigError for the first invalid setting: before a dataset is loaded."""
    make_config(settings, train_samples=1)


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not is_valid_run_id(run_id):
        raise ConfigError("run_id", "1-64 characters of letters, digits, '_', '.', '-', "
                                    f"starting with a letter or digit; got {run_id!r}")


def _check_publish_every(config: RunConfig) -> None:
    # An open window's gradients stay in the stream, and workers stop at max_pending.
    if config.publish_every > max(1, config.max_pending // 2):
        raise ConfigError("publish_every", f"must be at most max_pending / 2 "
                                           f"({max(1, config.max_pending // 2)}), got "
                                           f"{config.publish_every}: workers would wait for "
                                           "a publication that cannot come")
