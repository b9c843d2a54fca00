"""The compiled float32 -> 16-bit conversions give numpy's results, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from gemq.wire import halfprecision

RNG = np.random.default_rng(20261204)
#: Random bit patterns: every exponent, sign and mantissa, NaNs and infinities included.
RANDOM_BITS = RNG.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32)
#: Every 97th pattern of the magnitudes below float16's smallest normal (2^-14) and a little
#: above: the subnormal path's shifts and ties, both signs.
SMALL = np.arange(0, 0x38900000, 97, dtype=np.uint32)
EDGES = np.array([0.0, -0.0, 2**-24, 2**-25, 3 * 2**-26, 2**-14, 65504.0, 65519.99,
                  65520.0, 65536.0, 1e30, np.inf, -np.inf, 1.0 + 2**-11, 1.0 + 3 * 2**-11],
                 np.float32)


def numpy_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 by the definition, in numpy: round to nearest even on the 16 bits dropped."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(values), 0x7FC0, rounded).astype(np.uint16)


def all_inputs() -> np.ndarray:
    return np.concatenate([RANDOM_BITS, SMALL, SMALL | np.uint32(0x80000000),
                           EDGES.view(np.uint32), (-EDGES).view(np.uint32)]).view(np.float32)


def test_float16_is_numpys_for_every_number_and_keeps_nan() -> None:
    values = all_inputs()
    with np.errstate(all="ignore"):
        expected = values.astype(np.float16)
    got = halfprecision.to_float16(values)
    assert got.dtype == np.float16 and got.shape == values.shape
    numbers = ~np.isnan(values)
    wrong = values[numbers][got.view(np.uint16)[numbers] != expected.view(np.uint16)[numbers]]
    assert wrong.size == 0, f"{wrong.size} differ, first: bits {wrong.view(np.uint32)[0]:#x}"
    assert np.isnan(got[~numbers]).all() and (~numbers).sum() > 1000


def test_bfloat16_rounds_like_the_definition_and_keeps_nan() -> None:
    values = all_inputs()
    np.testing.assert_array_equal(halfprecision.to_bfloat16_bits(values),
                                  numpy_bfloat16_bits(values))


@pytest.mark.parametrize("convert", [halfprecision.to_float16, halfprecision.to_bfloat16_bits])
def test_conversions_take_any_float_array(convert) -> None:  # type: ignore[no-untyped-def]
    grid = np.linspace(-2, 2, 12, dtype=np.float64).reshape(3, 4)[:, ::2]  # not contiguous
    out = convert(grid)
    assert out.shape == (6,)
    np.testing.assert_array_equal(out, convert(np.ascontiguousarray(grid, np.float32).ravel()))


@pytest.mark.parametrize("convert", [halfprecision.to_bfloat16_bits, halfprecision.to_float16])
def test_conversions_write_into_a_misaligned_buffer(convert) -> None:  # type: ignore[no-untyped-def]
    """As encode does: straight into the message, after a header of odd length."""
    values = all_inputs()[:100_003]
    expected = convert(values).view(np.uint16)
    message = np.zeros(7 + 2 * values.size, np.uint8)
    written = convert(values, out=message[7:])
    np.testing.assert_array_equal(message[7:].view(np.uint16), expected)
    assert np.shares_memory(written, message) and message[:7].sum() == 0
    with pytest.raises(ValueError, match="do not fit"):
        convert(values, out=message[5:])
