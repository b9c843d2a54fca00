"""float32 to the 16-bit wire types, in one compiled pass each.

A worker that sends 16-bit gradients narrows every gradient it computes. numpy takes
several full passes for bfloat16 (add the rounding bias, shift, narrow, find NaNs) and
converts to float16 in software one element at a time, which for a large model cost about
as much as the training step itself, or several times as much (measured in
docs/performance.md: "Converting to bfloat16 used to cost more than it saved"). These
loops read each float32 once and write its 16 bits once: float16 bit for bit what numpy's
``astype`` gives for every number, bfloat16 the round-to-nearest-even definition
(``tests/test_halfprecision.py`` compares them on millions of bit patterns and every
magnitude around float16's subnormals).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gemq.jit import compiled

_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_INF32 = np.uint32(0x7F800000)
#: bfloat16's quiet NaN: every NaN becomes it (a NaN must never round to a number).
_BF16_NAN = np.uint16(0x7FC0)
#: float16's quiet NaN and infinity (without the sign).
_F16_NAN, _F16_INF = np.uint32(0x7E00), np.uint32(0x7C00)
#: The float32 bits of 65536 (2^16): from here on float16 overflows to infinity (values in
#: [65520, 65536) get there by rounding, in the normal path).
_F16_OVERFLOW = np.uint32((127 + 16) << 23)
#: The float32 bits of 2^-14, float16's smallest normal number.
_F16_MIN_NORMAL = np.uint32((127 - 14) << 23)
#: Rebias the exponent from float32's 127 to float16's 15, plus the rounding bias.
_REBIAS = np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)


@compiled
def _bfloat16_into(bits: np.ndarray, out: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        b = bits[i]
        if (b & _ABS) > _INF32:
            out[i] = _BF16_NAN
        else:  # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit
            out[i] = np.uint16((b + (np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1)))) >> 16)


@compiled
def _float16_into(bits: np.ndarray, out: np.ndarray) -> None:
    # Every case computed, then one chosen: no branch on the values.
    one = np.uint32(1)
    for i in range(bits.shape[0]):
        b = bits[i]
        a = b & _ABS
        # Normal: rebias the exponent, round to nearest even on the 13 bits dropped.
        normal = (a + _REBIAS + ((a >> 13) & one)) >> 13
        # Subnormal (below 2^-14): the value in units of 2^-24 is the mantissa shifted
        # right by 126 - exponent, at least 14; from 25 on it rounds to zero (as do float32
        # subnormals, exponent 0, which the clamp sends there).
        shift = np.uint32(min(max(np.int32(126) - np.int32(a >> 23), np.int32(14)),
                              np.int32(25)))
        mantissa = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        kept = mantissa >> shift
        dropped = mantissa & ((one << shift) - one)
        halfway = one << (shift - one)
        up = (dropped > halfway) | ((dropped == halfway) & ((kept & one) == one))
        subnormal = kept + np.uint32(up)
        half = subnormal if a < _F16_MIN_NORMAL else normal
        # From 2^16 on: infinity, or NaN (values in [65520, 65536) round up to infinity
        # in the normal case).
        half = half if a < _F16_OVERFLOW else (_F16_NAN if a > _INF32 else _F16_INF)
        out[i] = np.uint16(half | ((b & _SIGN) >> 16))


def to_bfloat16_bits(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The bfloat16 bit patterns of ``values`` (rounded to nearest, ties to even), as uint16,
    in ``out`` where given (any alignment).

    Every NaN becomes bfloat16's quiet NaN; values beyond bfloat16's range become
    infinities, which decoding refuses like any other non-finite value.
    """
    return _narrowed(values, _bfloat16_into, out)


def to_float16(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``values`` as float16 (rounded to nearest, ties to even), as numpy's ``astype`` gives
    them, in ``out`` where given (any alignment); NaN stays NaN (as float16's quiet NaN,
    with its sign)."""
    return _narrowed(values, _float16_into, out).view("<f2")


def _narrowed(values: np.ndarray, into: Any, out: np.ndarray | None) -> np.ndarray:
    """The 16-bit patterns ``into`` writes for the float32 bits of ``values``, flattened,
    into ``out`` (a new array if None)."""
    bits = np.ascontiguousarray(values, dtype="<f4").reshape(-1).view(np.uint32)
    out = np.empty(bits.shape[0], np.uint16) if out is None else out.view(np.uint16)
    if out.shape != bits.shape:
        raise ValueError(f"{bits.shape[0]} values do not fit {out.shape[0]} 16-bit elements")
    into(bits, out)
    return out
