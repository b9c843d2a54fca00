"""numba's compiler, set up once for every compiled loop of gemq (the wire format's
conversions, gemq/wire/; the aggregation rules' update kernel, gemq/aggregation/kernel.py).

numba compiles a loop on first use and caches the machine code next to the module that
defines it, or in the user's cache directory (``NUMBA_CACHE_DIR``) where that is not
writable; with neither, every process compiles it again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from numba import njit


def compiled(function: Callable[..., Any], fastmath: set[str] | bool = False) -> Any:
    """``function`` compiled by numba, its machine code cached where a cache can be written."""
    jit = functools.partial(njit, fastmath=fastmath, boundscheck=False, nogil=True,
                            error_model="numpy")
    try:
        return jit(function, cache=True)
    except RuntimeError:  # no writable cache location at all: compile in every process
        return jit(function, cache=False)
