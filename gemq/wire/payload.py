"""A gradient payload's elements as float32, checked finite and bounded, in one compiled pass.

The aggregator decodes every gradient before any of it touches the parameters. numpy took
several passes for that: for float32, a ``min`` and a ``max`` over the payload, which is a
view of the message bytes and so, after a header of any length, usually misaligned, which
numpy reads through a buffered copy, several times slower than an aligned array (measured
in docs/performance.md: "Large values without extra copies"); for 16-bit payloads, a
widening pass first. These loops read each element once
(and for 16-bit payloads write its float32 once), whatever the alignment.

The check works on bit patterns, so it is exact and needs no floating-point compare: a
float32 is finite with ``|x| <= limit`` exactly when its bits without the sign are at most
those of the largest float32 not above ``limit`` (the bits of non-negative floats are
ordered as their values; infinity and every NaN lie above all finite ones).
"""

from __future__ import annotations

import functools

import numpy as np

from gemq.jit import compiled

_ABS = np.uint32(0x7FFFFFFF)
#: float16 bit pattern -> float32 bit pattern, for all 65536 patterns (numpy's conversion).
_FLOAT16_TO_FLOAT32_BITS = (np.arange(1 << 16, dtype=np.uint16).view(np.float16)
                            .astype(np.float32).view(np.uint32))


@functools.cache  # one limit in practice, asked once per gradient decoded
def largest_float32_bits(limit: float) -> np.uint32:
    """The bits of the largest non-negative float32 that is at most ``limit``."""
    nearest = np.float32(limit)
    if float(nearest) > limit:  # rounded up: step one float32 down
        nearest = np.nextafter(nearest, np.float32(0))
    return np.uint32(nearest.view(np.uint32))


@compiled
def _count_beyond(bits: np.ndarray, limit: np.uint32) -> int:
    beyond = 0
    for i in range(bits.shape[0]):
        beyond += int((bits[i] & _ABS) > limit)
    return beyond


@compiled
def _bfloat16_widen_count(bits: np.ndarray, out: np.ndarray, limit: np.uint32) -> int:
    beyond = 0
    for i in range(bits.shape[0]):
        wide = np.uint32(bits[i]) << np.uint32(16)
        out[i] = wide
        beyond += int((wide & _ABS) > limit)
    return beyond


@compiled
def _float16_widen_count(bits: np.ndarray, out: np.ndarray, table: np.ndarray,
                         limit: np.uint32) -> int:
    beyond = 0
    for i in range(bits.shape[0]):
        wide = table[bits[i]]
        out[i] = wide
        beyond += int((wide & _ABS) > limit)
    return beyond


def checked_float32(raw: np.ndarray, dtype: str, limit: float) -> tuple[np.ndarray, bool]:
    """(the payload ``raw`` of wire type ``dtype`` as flat float32, whether every element is
    finite with ``|x| <= limit``). A float32 payload is returned as it is (no copy, at any
    alignment); a 16-bit one is widened into a new array."""
    limit_bits = largest_float32_bits(limit)
    if dtype == "float32":
        return raw, _count_beyond(raw.view(np.uint32), limit_bits) == 0
    out = np.empty(raw.shape[0], np.uint32)
    if dtype == "bfloat16":
        beyond = _bfloat16_widen_count(raw.view(np.uint16), out, limit_bits)
    elif dtype == "float16":
        beyond = _float16_widen_count(raw.view(np.uint16), out, _FLOAT16_TO_FLOAT32_BITS,
                                      limit_bits)
    else:
        raise ValueError(f"unknown wire dtype {dtype!r}")
    return out.view(np.float32), beyond == 0
