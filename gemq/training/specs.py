"""Resolving ``pkg.module:factory`` specs for users' own models and datasets."""

from __future__ import annotations

import importlib
from collections.abc import Callable
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
        raise SpecError(f"{what} {spec!r}: cannot import {module_name!r}: "
                        f"{type(e).__name__}: {e}") from e
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise SpecError(f"{what} {spec!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise SpecError(f"{what} {spec!r}: {attribute!r} is not callable")
    return target


def spec_of(factory: Callable[..., Any]) -> str:
    """The ``module:qualname`` spec of an importable callable."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or "<" in qualname:
        raise SpecError(f"{factory!r} is not importable by name; define it at module level")
    return f"{module}:{qualname}"
