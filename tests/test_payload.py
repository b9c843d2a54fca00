"""gemq.wire.payload: widening and the bounds check, against numpy's own conversions and
compares."""

from __future__ import annotations

import numpy as np
import pytest

from gemq.wire.payload import checked_float32, largest_float32_bits

LIMIT = 1e12
ALL_16_BIT = np.arange(1 << 16, dtype=np.uint16)


def reference_within(values: np.ndarray, limit: float) -> bool:
    """numpy's answer, in float64: every element finite and within +-limit."""
    with np.errstate(invalid="ignore"):  # signalling NaNs among the patterns
        wide = values.astype(np.float64)
    return bool(np.isfinite(wide).all() and (np.abs(wide) <= limit).all())


def misaligned(values: np.ndarray, offset: int) -> np.ndarray:
    """``values`` as a view ``offset`` bytes into a buffer (as a payload after a header)."""
    raw = bytes(offset) + values.tobytes()
    return np.frombuffer(raw, values.dtype, offset=offset)


def test_largest_float32_bits_is_at_most_the_limit_and_the_next_float32_is_above() -> None:
    for limit in (1e12, 1.0, 3.0e38, 1e-3, 16777217.0):
        bits = largest_float32_bits(limit)
        below = np.uint32(bits).view(np.float32)
        above = np.nextafter(below, np.float32(np.inf))
        assert float(below) <= limit < float(above), limit


@pytest.mark.parametrize("dtype, wire", [("bfloat16", "<u2"), ("float16", "<f2")])
def test_every_16_bit_pattern_widens_as_numpy_does(dtype: str, wire: str) -> None:
    raw = ALL_16_BIT.view(wire)
    expected = ((ALL_16_BIT.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16"
                else raw.astype(np.float32))
    values, _ = checked_float32(raw, dtype, LIMIT)
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype, wire", [("bfloat16", "<u2"), ("float16", "<f2")])
def test_each_16_bit_pattern_alone_is_judged_as_numpy_judges_it(dtype: str, wire: str) -> None:
    # Limits that fall inside each type's range, so some finite patterns are refused too.
    for limit in (LIMIT, 1000.0, 0.5):
        widened, _ = checked_float32(ALL_16_BIT.view(wire), dtype, limit)
        # A sample of single-element payloads, every sign and exponent among them.
        for pattern in list(range(0, 1 << 16, 61)) + [0x7C00, 0xFC00, 0x7F80, 0xFF80, 0x7E00]:
            one = ALL_16_BIT[pattern:pattern + 1].view(wire)
            _, within = checked_float32(one, dtype, limit)
            assert within == reference_within(widened[pattern:pattern + 1], limit), (
                dtype, limit, hex(pattern))


def test_float32_boundary_non_finite_and_each_position() -> None:
    edge = np.uint32(largest_float32_bits(LIMIT)).view(np.float32)
    past = np.nextafter(edge, np.float32(np.inf))
    rng = np.random.default_rng(0)
    base = rng.standard_normal(1001).astype(np.float32)
    assert checked_float32(base, "float32", LIMIT)[1]
    for good in (edge, -edge, np.float32(0), np.float32(-0.0)):
        for at in (0, 500, 1000):
            values = base.copy()
            values[at] = good
            assert checked_float32(values, "float32", LIMIT)[1], (good, at)
    bad_bits = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                int(past.view(np.uint32)), int((-past).view(np.uint32))]
    for bits in bad_bits:
        for at in (0, 500, 1000):
            values = base.copy()
            values.view(np.uint32)[at] = bits
            assert not checked_float32(values, "float32", LIMIT)[1], (hex(bits), at)
            assert not reference_within(values, LIMIT)


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_misaligned_float32_is_checked_in_place(offset: int) -> None:
    values = np.random.default_rng(offset).standard_normal(4099).astype(np.float32)
    view = misaligned(values, offset)
    assert not view.flags.aligned or offset % 4 == 0
    checked, within = checked_float32(view, "float32", LIMIT)
    assert within and np.shares_memory(checked, view)
    broken = values.copy()
    broken[4098] = np.nan
    assert not checked_float32(misaligned(broken, offset), "float32", LIMIT)[1]


@pytest.mark.parametrize("dtype, wire", [("bfloat16", "<u2"), ("float16", "<f2")])
def test_misaligned_16_bit_payloads_widen_alike(dtype: str, wire: str) -> None:
    raw = ALL_16_BIT.view(wire)
    aligned, within = checked_float32(raw, dtype, LIMIT)
    shifted, shifted_within = checked_float32(misaligned(raw, 3), dtype, LIMIT)
    np.testing.assert_array_equal(shifted.view(np.uint32), aligned.view(np.uint32))
    assert within is shifted_within is False  # the patterns include infinities and NaNs


def test_empty_payload_and_unknown_dtype() -> None:
    values, within = checked_float32(np.empty(0, "<f4"), "float32", LIMIT)
    assert values.size == 0 and within
    with pytest.raises(ValueError, match="unknown wire dtype"):
        checked_float32(np.empty(0, "<f8"), "float64", LIMIT)
