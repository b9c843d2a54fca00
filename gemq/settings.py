"""Settings from the environment: every CLI option ``--some-flag`` has ``GEMQ_SOME_FLAG``.

This is the one module of the library that reads environment variables, and only because the
CLI hands it ``os.environ``: containers configure gemq without flags. Explicit flags win.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from gemq.errors import ConfigError

PREFIX = "GEMQ_"


def env_name(action: argparse.Action) -> str | None:
    """``--redis-url`` -> ``GEMQ_REDIS_URL``; None for positionals and --help."""
    long_options = [o for o in action.option_strings if o.startswith("--")]
    if not long_options or action.dest == "help":
        return None
    return PREFIX + long_options[0].removeprefix("--").replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Use ``GEMQ_<FLAG>`` variables as defaults of ``parser``'s options."""
    for action in parser._actions:  # argparse offers no public iterator over its options
        name = env_name(action)
        if name is None or name not in environ:
            continue
        parser.set_defaults(**{action.dest: _convert(action, name, environ[name])})


def _convert(action: argparse.Action, name: str, raw: str) -> object:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        lowered = raw.strip().lower()
        if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off", ""}:
            raise ConfigError(name, f"expected true or false, got {raw!r}")
        return lowered in {"1", "true", "yes", "on"}
    convert = action.type if callable(action.type) else str
    try:
        value = convert(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ConfigError(name, f"invalid value {raw!r}: {e}") from e
    if action.choices is not None and value not in action.choices:
        raise ConfigError(name, f"must be one of {', '.join(map(str, action.choices))}, "
                                f"got {raw!r}")
    return value
