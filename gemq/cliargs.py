"""The argparse pieces every ``gemq`` command shares, and ``GEMQ_*`` environment defaults.

Run settings become flags straight from gemq.config's table (``add_settings``): their
defaults, ranges, choices and help have one home. Every long option ``--some-flag`` also
reads ``GEMQ_SOME_FLAG`` (``apply_env_defaults``): containers configure gemq without flags,
and an explicit flag wins. This is the one module of the library that reads environment
variables, and only because the CLI hands it ``os.environ``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from gemq.config import AUTO, BUDGET, USER_SETTINGS, Setting
from gemq.errors import ConfigError

EXIT_USAGE = 2
#: gemq run's exit code for a run that finished with a poor result (gemq/records/verdict.py).
EXIT_POOR_RESULT = 3
ENV_PREFIX = "GEMQ_"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default (where it has one) and keeps the epilog's
    examples as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, without the usage block, and shows
    every option's default in --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        #: The GEMQ_ variables it could not read, by command ("" for the program's own).
        self.env_errors: dict[str, ConfigError] = {}
        #: Its subcommands' parsers, by name.
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_parser(setting: Setting) -> Callable[[str], Any]:
    """Reads a flag's text as the setting's type and checks its range (argparse's type=)."""
    def parse(text: str) -> Any:
        if setting.auto and text.strip().lower() == AUTO:
            return AUTO
        value = setting.kind(text)  # a ValueError becomes argparse's "invalid <type> value"
        try:
            setting.check(value)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{setting.name}: ")) from e
        return value

    parse.__name__ = setting.kind.__name__
    return parse


def add_settings(parser: argparse.ArgumentParser, groups: Iterable[str]) -> None:
    """Flags for the run settings of ``groups`` (gemq.config: TRAINING, BUDGET, TRANSPORT)."""
    for group_name in groups:
        group = parser.add_argument_group(group_name)
        target: Any = group.add_mutually_exclusive_group() if group_name == BUDGET else group
        for setting in (s for s in USER_SETTINGS if s.group == group_name):
            typed = ({"choices": setting.offered_choices} if setting.choices
                     else {"type": _value_parser(setting)})
            target.add_argument(flag(setting.name), dest=setting.name,
                                default=setting.default, help=setting.help, **typed)


def settings_of(args: argparse.Namespace, groups: Iterable[str]) -> dict[str, Any]:
    """The run settings of ``groups`` that ``args`` holds, by RunConfig name."""
    wanted = set(groups)
    return {s.name: getattr(args, s.name) for s in USER_SETTINGS if s.group in wanted}


def add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="flags from a TOML file (key: the flag's name, e.g. lr = 0.05); "
                             "flags given here win; a run's config.toml reads back")


def add_redis(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="redis://[user:password@]host:port/db, rediss:// for TLS"
                             + ("" if required else "; default: a private embedded Redis"))


def add_run(parser: argparse.ArgumentParser, help: str = "the run id (required)") -> None:
    parser.add_argument("--run", dest="run_id", default=None, help=help)


def required(args: argparse.Namespace, dest: str, option: str) -> str:
    """The value of a required option. Checked here, not by argparse: a required argparse
    option ignores its environment default."""
    value = getattr(args, dest)
    if not value:
        env = ENV_PREFIX + option.removeprefix("--").replace("-", "_").upper()
        raise ConfigError(option, f"required for 'gemq {args.command}' (or set {env})")
    return str(value)


def env_name(action: argparse.Action) -> str | None:
    """``--redis-url`` -> ``GEMQ_REDIS_URL``; None for positionals and --help."""
    long_options = [o for o in action.option_strings if o.startswith("--")]
    if not long_options or action.dest == "help":
        return None
    return ENV_PREFIX + long_options[0].removeprefix("--").replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Use ``GEMQ_<FLAG>`` variables as defaults of ``parser``'s options."""
    for action in parser._actions:  # argparse offers no public iterator over its options
        name = env_name(action)
        if name is None or name not in environ:
            continue
        parser.set_defaults(**{action.dest: convert_value(action, name, environ[name])})


def convert_value(action: argparse.Action, name: str, raw: str) -> object:
    """``raw`` as ``action``'s option would read it; a ConfigError naming ``name`` (the
    variable or file key it came from) if it cannot."""
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
