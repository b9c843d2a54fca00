"""Resolving ``pkg.module:factory`` specs for users' own models and datasets."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gemq.errors import SpecError


def is_import_spec(spec: str) -> bool:
    return ":" in spec and not spec.startswith("mnist-idx:")


def load_factory(spec: str, what: str) -> Callable[..., Any]:
    """Import ``module:attribute`` and return it; it must be callable."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise SpecError(f"{what} {spec!r}: expected 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import can fail in any way; say which spec failed and why
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
            hint = (f" (run gemq from the folder that holds {e.name}, or add that folder "
                    f"to PYTHONPATH)")
        raise SpecError(f"{what} {spec!r}: cannot import {module_name!r}: "
                        f"{type(e).__name__}: {e}{hint}") from e
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise SpecError(f"{what} {spec!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise SpecError(f"{what} {spec!r}: {attribute!r} is not callable")
    return target


def call_factory(spec: str, what: str) -> Any:
    """Load the ``module:factory`` spec and call it with no arguments. Whatever the user's
    code raises becomes one SpecError naming the spec, the error and where it was raised
    (the innermost frame), the original chained for a debugger."""
    factory = load_factory(spec, what)
    try:
        return factory()
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        where = (f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno}, in "
                 f"{frames[-1].name})" if len(frames) > 1 else "")
        raise SpecError(f"{what} {spec!r} raised {type(e).__name__}: {e}{where}") from e


def spec_of(factory: Callable[..., Any]) -> str:
    """The ``module:qualname`` spec of an importable callable."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or "<" in qualname:
        raise SpecError(f"{factory!r} is not importable by name; define it at module level")
    return f"{module}:{qualname}"
