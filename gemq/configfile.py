"""``--config FILE``: a command's flags from a TOML file, and the file a run leaves behind.

A key is a flag's long name, with dashes or underscores (``lr``, ``snapshot-budget-mb``);
its value has the flag's type (``true``/``false`` for switches). Flags given on the command
line win over the file, and the file over ``GEMQ_<FLAG>`` variables. Each local run writes
its settings as ``config.toml`` beside its model, in the same form, so that
``gemq run --config runs/<run>/config.toml`` runs it again.

TOML, because Python reads it without a dependency (tomllib); the writer below covers the
flat tables of numbers, strings and booleans that settings are.
"""

from __future__ import annotations

import argparse
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gemq.cliargs import convert_value
from gemq.config import BUDGET_SETTINGS
from gemq.errors import ConfigError

#: Options a file cannot set: what names the file, and what only a person asks for.
_NOT_IN_FILES = frozenset({"help", "version", "config", "verbose"})


def read_config_file(path: Path) -> dict[str, Any]:
    """The file's keys and values; one ConfigError for a missing or malformed file, or a
    value that is a table or an array."""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as e:
        raise ConfigError("--config", f"cannot read {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", f"{path} is not valid TOML: {e}") from e
    for key, value in values.items():
        if isinstance(value, dict | list):
            raise ConfigError(f"{path}: {key}", "must be a number, a string or true/false, "
                                                "not a table or an array")
    return values


def apply_config_file(parser: argparse.ArgumentParser, path: Path,
                      argv: Sequence[str]) -> None:
    """Make the file's values ``parser``'s defaults, so that the flags in ``argv`` still win.
    A budget on the command line (--epochs or --steps) replaces the file's, whichever of
    the two that is."""
    options = {}
    for option in parser._actions:  # argparse offers no public iterator over its options
        names = [o.removeprefix("--") for o in option.option_strings if o.startswith("--")]
        if names and option.dest not in _NOT_IN_FILES:
            options[names[0]] = option
    values = read_config_file(path)
    budget_given = any(arg.split("=")[0] in ("--epochs", "--steps") for arg in argv)
    budget = {s.name for s in BUDGET_SETTINGS}
    defaults = {}
    for key, value in values.items():
        action = options.get(key.replace("_", "-"))
        if action is None:
            raise ConfigError(f"{path}: {key}", "not a flag of this command; it has: "
                                                + ", ".join(sorted(options)))
        if not (budget_given and action.dest in budget):
            defaults[action.dest] = convert_value(action, f"{path}: {key}", _as_text(value))
    parser.set_defaults(**defaults)


def _as_text(value: Any) -> str:
    """A TOML value as the text a flag would have carried."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def write_config_file(path: Path, values: Mapping[str, Any], header: str) -> Path:
    """``values`` (flag names to numbers, strings or booleans; None left out) as a TOML
    file that ``--config`` reads back, under a comment ``header``."""
    lines = [f"# {line}" for line in header.splitlines()]
    for key, value in values.items():
        if value is not None:
            lines.append(f"{key.replace('_', '-')} = {_toml_value(value)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
