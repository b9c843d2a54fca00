"""Gradient wire format: round trips, zero copy, every decoder rejection, fuzzing."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemq.aggregation import rejections
from gemq.errors import CodecError
from gemq.wire import codec
from gemq.wire.codec import Expected, GradientMessage, decode, encode

SIZE = 10
EXPECTED = Expected(run_id="run-1", layout_id="layout-abc", size=SIZE)
EXPECTED16 = Expected(run_id="run-1", layout_id="layout-abc", size=SIZE, dtype="float16")
EXPECTED_BF16 = Expected(run_id="run-1", layout_id="layout-abc", size=SIZE, dtype="bfloat16")
BY_DTYPE = {"float32": EXPECTED, "float16": EXPECTED16, "bfloat16": EXPECTED_BF16}
GRADIENT = np.linspace(-2.0, 2.5, SIZE).astype(np.float64) + 1e-3  # not exact in float16

# The valid header, field by field, in wire order.
HEADER = [codec.FORMAT_VERSION, "run-1", "worker-7", 42, 64, 0.125, "float32", "layout-abc"]
FIELD = {name: i for i, name in enumerate(
    ["format", "run_id", "worker_id", "param_version", "samples", "loss", "dtype", "layout_id"])}


def wire(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` as the payload elements of ``dtype``, computed independently of codec."""
    if dtype == "bfloat16":  # round to nearest even in 64-bit integers, keep the upper 16 bits
        as32 = values.astype(np.float32)
        bits = as32.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return values.astype(codec.WIRE_DTYPES[dtype])


def widened(values: np.ndarray, dtype: str) -> np.ndarray:
    """What decoding must return for ``values`` sent as ``dtype``: float32."""
    elements = wire(values, dtype)
    if dtype == "bfloat16":
        return (elements.astype(np.uint32) << 16).view(np.float32)
    return elements.astype(np.float32)


def make(**changes: object) -> memoryview:
    kwargs: dict[str, object] = {"run_id": "run-1", "worker_id": "worker-7", "param_version": 42,
                                 "samples": 64, "loss": 0.125, "layout_id": "layout-abc",
                                 "gradient": GRADIENT, "dtype": "float32"}
    kwargs.update(changes)
    return encode(**kwargs)  # type: ignore[arg-type]


def raw(header: object, payload: object = None, *, dtype: str = "float32") -> bytes:
    """A message built by hand: any header object, any payload (default: GRADIENT)."""
    if payload is None:
        payload = wire(GRADIENT, dtype).tobytes()
    return msgpack.packb(header) + msgpack.packb(payload, use_bin_type=True)


def with_field(name: str, value: object) -> bytes:
    header = list(HEADER)
    header[FIELD[name]] = value
    return raw(header)


def reason(message: object, expected: Expected = EXPECTED) -> str:
    with pytest.raises(CodecError) as info:
        decode(message, expected)  # type: ignore[arg-type]
    assert info.value.reason in codec.REASONS
    return info.value.reason


# --------------------------------------------------------------------------------------------
# Round trips and zero copy.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip(dtype: str) -> None:
    expected = BY_DTYPE[dtype]
    data = make(dtype=dtype, param_version=2**62, samples=2**31, loss=-3.5)
    msg = decode(data, expected)
    assert isinstance(msg, GradientMessage)
    assert msg.run_id == "run-1"
    assert msg.worker_id == "worker-7"
    assert msg.param_version == 2**62
    assert msg.samples == 2**31
    assert msg.loss == -3.5 and type(msg.loss) is float
    assert msg.dtype == dtype
    assert msg.layout_id == "layout-abc"
    assert msg.gradient.dtype == np.float32  # 16-bit payloads arrive widened
    assert msg.gradient.shape == (SIZE,)
    np.testing.assert_array_equal(msg.gradient, widened(GRADIENT, dtype))
    if dtype != "float32":  # the cast is lossy: it really went through 16 bits
        assert not np.array_equal(msg.gradient, GRADIENT.astype(np.float32))
    assert len(data) < SIZE * codec.WIRE_DTYPES[dtype].itemsize + 100


def test_bfloat16_rounds_to_nearest_even_and_keeps_float32_range() -> None:
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3e38, -1e-30, 0.0], np.float32)
    bits = codec.to_bfloat16_bits(values)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even pattern, 1.
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.0 + 2**-6
    assert np.isfinite(back[3]) and back[3] == pytest.approx(3e38, rel=2**-8)
    assert back[4] == pytest.approx(-1e-30, rel=2**-8) and back[5] == 0.0


@pytest.mark.parametrize("bits", [0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0xFF800000])
def test_bfloat16_never_turns_nan_or_inf_into_a_number(bits: int) -> None:
    # 0xFFFFFFFF + the rounding bias wraps around in uint32: it must still not become 0.
    values = np.array([bits], np.uint32).view(np.float32)
    pattern = int(codec.to_bfloat16_bits(values)[0])
    assert not np.isfinite((np.array([pattern], np.uint32) << 16).view(np.float32)[0])


def test_round_trip_lower_bounds() -> None:
    msg = decode(make(param_version=0, samples=1, loss=0), EXPECTED)
    assert (msg.param_version, msg.samples) == (0, 1)
    assert msg.loss == 0.0 and type(msg.loss) is float


# --------------------------------------------------------------------------------------------
# The optional accuracy: a 9th header field.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("accuracy", [0.0, 0.4375, 1.0])
def test_accuracy_round_trip(dtype: str, accuracy: float) -> None:
    data = make(dtype=dtype, accuracy=accuracy)
    msg = decode(data, BY_DTYPE[dtype])
    assert msg.accuracy == accuracy and type(msg.accuracy) is float
    assert msg.loss == 0.125 and msg.samples == 64
    np.testing.assert_array_equal(msg.gradient, widened(GRADIENT, dtype))
    assert len(data) == len(make(dtype=dtype)) + 9  # one msgpack float64 more


def test_a_message_without_accuracy_is_the_8_field_format() -> None:
    """A sender with no accuracy writes what senders wrote before the field, byte for byte;
    those messages, and a 9th field of nil, decode with accuracy None."""
    data = make()
    assert data == msgpack.packb(HEADER) + msgpack.packb(
        GRADIENT.astype("<f4").tobytes(), use_bin_type=True)
    assert make(accuracy=None) == data
    assert decode(data, EXPECTED).accuracy is None
    assert decode(raw([*HEADER, None]), EXPECTED).accuracy is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_encode_gives_a_read_only_message_msgpack_reads(dtype: str) -> None:
    data = make(dtype=dtype)
    assert isinstance(data, memoryview) and data.readonly
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    header, payload = list(unpacker)
    assert header == [*HEADER[:6], dtype, HEADER[7]]
    assert payload == wire(GRADIENT, dtype).tobytes()


def test_integer_accuracy_on_the_wire_is_read_as_float() -> None:
    for value in (0, 1):
        msg = decode(raw([*HEADER, value]), EXPECTED)
        assert msg.accuracy == float(value) and type(msg.accuracy) is float


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.0625, 1.0625, -1, 2,
                                   1e300],
                         ids=["nan", "inf", "-inf", "below", "above", "-1", "2", "huge"])
def test_an_accuracy_outside_0_1_is_a_bad_header(value: float) -> None:
    assert reason(raw([*HEADER, value])) == "bad_header"
    assert reason(make(accuracy=value)) == "bad_header"  # what a buggy sender would send


@pytest.mark.parametrize("value", ["0.5", True, False, [0.5], b"\x00", {}],
                         ids=["str", "true", "false", "list", "bin", "map"])
def test_a_9th_field_that_is_not_a_number_is_malformed(value: object) -> None:
    assert reason(raw([*HEADER, value])) == "malformed"


def test_a_header_of_10_fields_is_malformed() -> None:
    assert reason(raw([*HEADER, 0.5, 0.5])) == "malformed"
    assert reason(raw([*HEADER, 0.5, None])) == "malformed"


def test_the_accuracy_is_checked_with_the_header_before_the_run() -> None:
    header = [*HEADER, 1.5]
    header[FIELD["run_id"]] = "other-run"
    assert reason(raw(header)) == "bad_header"
    header[-1] = 0.5
    assert reason(raw(header)) == "wrong_run"


def test_integer_loss_on_the_wire_is_read_as_float() -> None:
    msg = decode(with_field("loss", 3), EXPECTED)  # encode() always writes a float
    assert msg.loss == 3.0 and type(msg.loss) is float


def test_encode_accepts_float32_input_and_size_zero() -> None:
    data = make(gradient=GRADIENT.astype(np.float32))
    np.testing.assert_array_equal(decode(data, EXPECTED).gradient, GRADIENT.astype(np.float32))
    empty = Expected(run_id="run-1", layout_id="layout-abc", size=0)
    assert decode(make(gradient=np.zeros(0)), empty).gradient.shape == (0,)


@pytest.mark.parametrize("wrap", [bytes, memoryview])
def test_zero_copy_and_read_only(wrap: type) -> None:
    data = wrap(make())
    msg = decode(data, EXPECTED)
    gradient = msg.gradient
    assert gradient.base is not None
    assert not gradient.flags.owndata
    assert np.shares_memory(gradient, np.frombuffer(memoryview(data), dtype=np.uint8))
    assert not gradient.flags.writeable
    with pytest.raises(ValueError):
        gradient[0] = 1.0


def test_bytearray_input_gives_read_only_gradient() -> None:
    """The message's gradient is documented as a read-only view, whatever buffer it came in."""
    buffer = bytearray(make())
    msg = decode(buffer, EXPECTED)
    assert np.shares_memory(msg.gradient, np.frombuffer(buffer, dtype=np.uint8))
    assert not msg.gradient.flags.writeable


# --------------------------------------------------------------------------------------------
# Every rejection the decoder raises.
# --------------------------------------------------------------------------------------------

def test_decoder_reasons_are_the_documented_ones() -> None:
    assert set(codec.REASONS) == {
        "malformed", "too_large", "bad_format", "bad_header", "wrong_run", "wrong_layout",
        "wrong_dtype", "wrong_length", "non_finite", "out_of_range"}


def test_the_aggregator_adds_its_own_reasons_beside_the_decoders() -> None:
    assert set(rejections.REASONS) == {
        "too_stale", "future_version", "bad_sender", "unknown_sender", "snapshot_gone"}
    assert not set(rejections.REASONS) & set(codec.REASONS)


@pytest.mark.parametrize("message", ["not bytes", None, 12, [1, 2], np.zeros(4, np.uint8)],
                         ids=["str", "none", "int", "list", "ndarray"])
def test_malformed_not_bytes(message: object) -> None:
    assert reason(message) == "malformed"


@pytest.mark.parametrize("message", [
    b"",
    b"\xc1",  # the one byte msgpack never uses
    msgpack.packb(7) + msgpack.packb(b"x" * 40, use_bin_type=True),  # header not an array
    msgpack.packb({"a": 1}) + msgpack.packb(b"x" * 40, use_bin_type=True),  # a map
    raw(HEADER[:7]),  # 7 fields
    raw([*HEADER, "extra"]),  # 9 fields
    msgpack.packb(HEADER),  # no payload at all
    msgpack.packb(HEADER) + msgpack.packb(list(range(SIZE))),  # payload not a bin
    msgpack.packb(HEADER) + msgpack.packb(GRADIENT.astype("<f4").tobytes().decode("latin-1")),
    bytes(make()) + b"\x00",  # trailing byte
    bytes(make()) + bytes(make()),  # two messages back to back
    make()[:-1],  # one byte short
    b"\xff" * 50,
    # The header may hold no msgpack bin (max_bin_len=0): a bytes field is malformed.
    with_field("worker_id", b"worker-7"),
    with_field("run_id", b"run-1"),
    with_field("layout_id", b"layout-abc"),
], ids=["empty", "c1", "int-header", "map-header", "7-fields", "9-fields", "no-payload",
        "array-payload", "str-payload", "trailing-byte", "two-messages", "short", "ff",
        "bin-worker", "bin-run", "bin-layout"])
def test_malformed(message: bytes) -> None:
    assert reason(message) == "malformed"


def test_malformed_bin_length_lies() -> None:
    header = msgpack.packb(HEADER)
    payload = GRADIENT.astype("<f4").tobytes()  # 40 bytes
    assert reason(header + b"\xc4\x29" + payload) == "malformed"  # declares 41
    assert reason(header + b"\xc4\x27" + payload) == "malformed"  # declares 39
    assert reason(header + b"\xc6\xff\xff\xff\xff" + payload) == "malformed"
    assert reason(header + b"\xc5\x00") == "malformed"  # bin16 length cut short
    # Same payload, other bin widths that declare the right length: accepted.
    for prefix in (b"\xc4\x28", b"\xc5\x00\x28", b"\xc6\x00\x00\x00\x28"):
        msg = decode(header + prefix + payload, EXPECTED)
        np.testing.assert_array_equal(msg.gradient, GRADIENT.astype(np.float32))


def test_every_truncation_is_malformed() -> None:
    data = make()
    for cut in range(len(data)):
        assert reason(data[:cut]) == "malformed", cut


def test_too_large() -> None:
    data = make()
    assert reason(data, Expected("run-1", "layout-abc", SIZE, max_bytes=len(data) - 1)) == \
        "too_large"
    decode(data, Expected("run-1", "layout-abc", SIZE, max_bytes=len(data)))  # at the limit
    # Default limit: payload + HEADER_ALLOWANCE. Checked before anything is parsed.
    assert EXPECTED.byte_limit == SIZE * 4 + codec.HEADER_ALLOWANCE
    assert EXPECTED16.byte_limit == SIZE * 2 + codec.HEADER_ALLOWANCE
    assert reason(b"\x00" * (EXPECTED.byte_limit + 1)) == "too_large"
    assert reason(b"\x00" * EXPECTED.byte_limit) == "malformed"
    assert reason(bytes(data) + b"\x00" * codec.HEADER_ALLOWANCE) == "too_large"


@pytest.mark.parametrize("fmt", [0, 2, -1, 2**40, True, "1", None, 1.0, [1]],
                         ids=["0", "2", "-1", "big", "true", "str", "none", "float", "list"])
def test_bad_format(fmt: object) -> None:
    assert reason(with_field("format", fmt)) == "bad_format"


@pytest.mark.parametrize(("field", "value"), [
    ("worker_id", ""),
    ("worker_id", "has space"),
    ("worker_id", " lead"),
    ("worker_id", "-starts-with-dash"),
    ("worker_id", "w" * 65),
    ("worker_id", "tab\there"),
    ("worker_id", "new\nline"),
    ("worker_id", "w1\n"),  # trailing newline
    ("worker_id", "brace{x}"),
    ("worker_id", 7),
    ("worker_id", None),
    ("param_version", "42"),
    ("param_version", True),
    ("param_version", False),
    ("param_version", -1),
    ("param_version", 2**62 + 1),
    ("param_version", 42.0),
    ("param_version", None),
    ("samples", 0),
    ("samples", -64),
    ("samples", True),
    ("samples", 2**31 + 1),
    ("samples", 64.0),
    ("samples", "64"),
    ("loss", "0.5"),
    ("loss", True),
    ("loss", None),
    ("loss", [0.5]),
], ids=lambda v: repr(v)[:20])
def test_bad_header(field: str, value: object) -> None:
    assert reason(with_field(field, value)) == "bad_header"


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_loss_that_is_not_finite_is_the_training_diverging(loss: float) -> None:
    """Not a bad header: the run that stalls on it says the model diverged, where
    bad_header's hint blamed something other than gemq's workers."""
    assert reason(with_field("loss", loss)) == "non_finite"
    hint = rejections.hint("non_finite")
    assert "diverged" in hint and "other than gemq" not in hint


def test_worker_id_edge_cases_accepted() -> None:
    for worker in ("w", "w" * 64, "host-1:pid.2_3", "0"):
        assert decode(make(worker_id=worker), EXPECTED).worker_id == worker


@pytest.mark.parametrize("value", ["run-2", "", "RUN-1", "run-1 ", None, 1, 1.5])
def test_wrong_run(value: object) -> None:
    assert reason(with_field("run_id", value)) == "wrong_run"


@pytest.mark.parametrize("value", ["layout-abd", "", None, 0, ["layout-abc"]])
def test_wrong_layout(value: object) -> None:
    assert reason(with_field("layout_id", value)) == "wrong_layout"


def test_wrong_dtype() -> None:
    assert reason(make(dtype="float16")) == "wrong_dtype"  # run expects float32
    assert reason(make(dtype="float32"), EXPECTED16) == "wrong_dtype"
    for value in ("float64", "", None, 4):
        assert reason(with_field("dtype", value)) == "wrong_dtype"


def test_wrong_length() -> None:
    assert reason(make(gradient=np.zeros(SIZE - 1))) == "wrong_length"
    assert reason(make(gradient=np.zeros(SIZE + 1))) == "wrong_length"
    assert reason(make(gradient=np.zeros(0))) == "wrong_length"
    # A float16 message with an odd byte count, and with a float32-sized payload.
    header16 = list(HEADER)
    header16[FIELD["dtype"]] = "float16"
    assert reason(raw(header16, b"\x00" * (2 * SIZE + 1)), EXPECTED16) == "wrong_length"
    assert reason(raw(header16, np.zeros(SIZE, "<f4").tobytes()), EXPECTED16) == "wrong_length"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, SIZE - 1])
def test_non_finite(dtype: str, bad: float, where: int) -> None:
    gradient = GRADIENT.copy()
    gradient[where] = bad
    assert reason(make(gradient=gradient, dtype=dtype), BY_DTYPE[dtype]) == "non_finite"


@pytest.mark.parametrize("bad", [1e13, -3e38])
def test_out_of_range(bad: float) -> None:
    gradient = GRADIENT.copy()
    gradient[3] = bad
    assert reason(make(gradient=gradient)) == "out_of_range"


def test_largest_accepted_value() -> None:
    gradient = GRADIENT.copy()
    gradient[0] = -codec.MAX_ABS_GRADIENT
    assert decode(make(gradient=gradient), EXPECTED).gradient[0] == np.float32(-1e12)


def test_non_finite_from_raw_bits() -> None:
    payload = bytearray(np.zeros(SIZE, "<f4").tobytes())
    payload[4:8] = b"\x01\x00\x80\x7f"  # a signalling NaN
    assert reason(raw(HEADER, bytes(payload))) == "non_finite"
    payload16 = bytearray(np.zeros(SIZE, "<f2").tobytes())
    payload16[-2:] = b"\x00\xfc"  # float16 -inf
    header16 = list(HEADER)
    header16[FIELD["dtype"]] = "float16"
    assert reason(raw(header16, bytes(payload16)), EXPECTED16) == "non_finite"
    header16[FIELD["dtype"]] = "bfloat16"
    payload16[-2:] = b"\xc1\xff"  # a bfloat16 NaN
    assert reason(raw(header16, bytes(payload16)), EXPECTED_BF16) == "non_finite"


def test_checks_come_in_a_fixed_order() -> None:
    """With several faults, the first check wins: format, header, run, layout, dtype, length."""
    header = [2, "other-run", "bad id", -1, 0, math.nan, "float64", "other-layout"]
    assert reason(raw(header, b"\x00")) == "bad_format"
    header[0] = 1
    assert reason(raw(header, b"\x00")) == "bad_header"
    header[2:6] = ["w", 1, 1, 0.5]
    assert reason(raw(header, b"\x00")) == "wrong_run"
    header[1] = "run-1"
    assert reason(raw(header, b"\x00")) == "wrong_layout"
    header[7] = "layout-abc"
    assert reason(raw(header, b"\x00")) == "wrong_dtype"
    header[6] = "float32"
    assert reason(raw(header, b"\x00")) == "wrong_length"


# --------------------------------------------------------------------------------------------
# Fuzzing: decode raises CodecError or returns a valid message, never anything else.
# --------------------------------------------------------------------------------------------

def check_outcome(data: bytes, expected: Expected) -> None:
    try:
        msg = decode(data, expected)
    except CodecError as e:
        assert e.reason in codec.REASONS
        return
    assert isinstance(msg, GradientMessage)
    assert msg.gradient.shape == (expected.size,)
    assert msg.gradient.dtype == np.float32
    assert np.isfinite(msg.gradient).all()
    assert msg.run_id == expected.run_id and msg.layout_id == expected.layout_id
    assert msg.dtype == expected.dtype
    assert isinstance(msg.worker_id, str) and msg.worker_id
    assert isinstance(msg.param_version, int) and msg.param_version >= 0
    assert isinstance(msg.samples, int) and msg.samples >= 1
    assert math.isfinite(msg.loss)
    assert msg.accuracy is None or (type(msg.accuracy) is float and 0 <= msg.accuracy <= 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    check_outcome(data, EXPECTED)
    check_outcome(data, Expected("run-1", "layout-abc", 0))


VALID = {dtype: make(dtype=dtype) for dtype in BY_DTYPE}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(BY_DTYPE)), st.data())
def test_fuzz_mutated_message(dtype: str, data: st.DataObject) -> None:
    message = bytearray(VALID[dtype])
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(message) - 1), st.integers(0, 255)),
                               min_size=1, max_size=8))
    for position, value in edits:
        message[position] = value
    check_outcome(bytes(message), BY_DTYPE[dtype])
