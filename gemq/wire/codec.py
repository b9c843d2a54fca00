"""Wire format of a gradient message, and its validation.

A message is two msgpack objects back to back:

1. a header array ``[format, run_id, worker_id, param_version, samples, loss, dtype,
   layout_id, accuracy]``, whose last field is optional (see ACCURACY below);
2. a msgpack ``bin`` holding the flat little-endian gradient: float32, or, when the run asks
   for half the bytes, float16 or bfloat16 (the upper 16 bits of a float32, rounded to
   nearest even: float32's range with 8 bits of mantissa).

Decoding reads the header with msgpack and the ``bin`` length by hand, so a float32 gradient
is a ``numpy.frombuffer`` view of the message bytes: no copy. 16-bit payloads are widened to
float32 once, here, so that every check and every rule works on float32; widening and the
check that every element is finite and bounded are one compiled pass (gemq/wire/payload.py).
There is no pickle anywhere.

ACCURACY, the share of the gradient's minibatch its model classified right, came after the
first readers: a header of 8 fields (an older sender) or with nil there carries none, and a
reader accepts both. A 9th field that is neither nil nor a number makes the header
malformed; a number that is not within [0, 1] (NaN included) is a bad header, so the
gradient is refused, as one with a non-finite loss is (non_finite): a sender that
miscounts its minibatch is not trusted with the parameters either. An aggregator older
than the field refuses 9-field headers as malformed: upgrade aggregators before workers.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack
import numpy as np

from gemq.errors import CodecError
from gemq.ids import is_valid_worker_id

FORMAT_VERSION = 1
#: The dtype of the payload's elements, per wire type (bfloat16: raw 16-bit patterns).
WIRE_DTYPES: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
                                         "bfloat16": np.dtype("<u2")}
#: A message as it travels: ``encode`` makes read-only memoryviews, and Redis gives large
#: values back as such (gemq/state/bulkreads.py), small ones as ``bytes``.
Message = bytes | bytearray | memoryview
#: Bytes of message allowed beyond the payload (the header is about 100 bytes).
HEADER_ALLOWANCE = 64 * 1024
_HEADER_FIELDS = 9
#: Headers from senders that predate the accuracy field.
_LEGACY_HEADER_FIELDS = 8
#: The longest header possible: 9 fields, none longer than 256 bytes plus its tag.
_HEADER_MAX_BYTES = 1 + _HEADER_FIELDS * (256 + 9)
_MAX_VERSION = 2**62

# The decoder's rejection reasons; each one is a counter in Redis (counters hash, per
# worker too).
MALFORMED = "malformed"
TOO_LARGE = "too_large"
BAD_FORMAT = "bad_format"
BAD_HEADER = "bad_header"
WRONG_RUN = "wrong_run"
WRONG_LAYOUT = "wrong_layout"
WRONG_DTYPE = "wrong_dtype"
WRONG_LENGTH = "wrong_length"
NON_FINITE = "non_finite"
OUT_OF_RANGE = "out_of_range"
REASONS = (MALFORMED, TOO_LARGE, BAD_FORMAT, BAD_HEADER, WRONG_RUN, WRONG_LAYOUT,
           WRONG_DTYPE, WRONG_LENGTH, NON_FINITE, OUT_OF_RANGE)
# The aggregator refuses valid messages for reasons of its own (the run's versions, the
# stream entry's sender): gemq/aggregation/rejections.py.
#: Gradient elements beyond this magnitude are refused: no real training produces them, and
#: applied they would overflow float32 parameters and energies.
MAX_ABS_GRADIENT = 1e12


@dataclass(frozen=True)
class GradientMessage:
    run_id: str
    worker_id: str
    param_version: int
    samples: int
    loss: float
    dtype: str
    layout_id: str
    gradient: np.ndarray  # float32, read-only (a view into the message bytes for float32)
    accuracy: float | None = None  # in [0, 1]; None: the sender measured none


@dataclass(frozen=True)
class Expected:
    """What a message must match to be accepted for a run."""

    run_id: str
    layout_id: str
    size: int
    dtype: str = "float32"
    max_bytes: int = 0  # 0: payload size + HEADER_ALLOWANCE

    @property
    def byte_limit(self) -> int:
        payload = self.size * WIRE_DTYPES[self.dtype].itemsize
        return self.max_bytes or payload + HEADER_ALLOWANCE


def encode(*, run_id: str, worker_id: str, param_version: int, samples: int, loss: float,
           layout_id: str, gradient: np.ndarray, dtype: str = "float32",
           accuracy: float | None = None) -> memoryview:
    """Encode one gradient; ``gradient`` is flat and is cast to the wire dtype. Without an
    ``accuracy`` the header is the 8-field one, which every reader accepts.

    The gradient is written once, into the message (narrowed on the way for 16-bit types);
    the message is a read-only ``memoryview``, bytes-like for Redis, numpy and msgpack.
    """
    header = [FORMAT_VERSION, run_id, worker_id, int(param_version), int(samples),
              float(loss), dtype, layout_id]
    if accuracy is not None:
        header.append(float(accuracy))
    flat = np.asarray(gradient).reshape(-1)
    message, payload = frame(header, flat.size * WIRE_DTYPES[dtype].itemsize)
    wire_elements(flat, dtype, out=payload)
    return message.data.toreadonly()


def frame(header: list[object], payload_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A message of ``header`` and a payload of ``payload_bytes``, the payload left to fill:
    (the message, its payload part), as uint8 arrays. numpy, not ``bytes``: a fresh buffer
    of megabytes is faulted in page by page, and numpy's are backed by huge pages (measured
    in docs/performance.md: "Large values without extra copies")."""
    head = msgpack.packb(header) + _bin_header(payload_bytes)
    message = np.empty(len(head) + payload_bytes, np.uint8)
    message[:len(head)] = np.frombuffer(head, np.uint8)
    return message, message[len(head):]


def decode(message: Message, expected: Expected) -> GradientMessage:
    """Decode and validate; raises CodecError with one of REASONS, never anything else."""
    if not isinstance(message, Message):
        raise CodecError(MALFORMED, f"message is {type(message).__name__}, not bytes")
    if len(message) > expected.byte_limit:
        raise CodecError(TOO_LARGE, f"{len(message)} bytes > limit {expected.byte_limit}")
    header, offset = _read_header(message)
    fields = _check_header(header, expected)
    payload = _read_bin(message, offset)
    wire_dtype = WIRE_DTYPES[fields["dtype"]]
    itemsize = wire_dtype.itemsize
    if len(payload) != expected.size * itemsize:
        raise CodecError(WRONG_LENGTH, f"{len(payload)} payload bytes, expected "
                                       f"{expected.size * itemsize}")
    from gemq.wire import payload as elements  # compiled by numba: only readers pay for it

    gradient, within = elements.checked_float32(np.frombuffer(payload, dtype=wire_dtype),
                                                fields["dtype"], MAX_ABS_GRADIENT)
    gradient.flags.writeable = False  # may be a view of the message: never written through
    if not within:
        _refuse_values(gradient)
    return GradientMessage(**fields, gradient=gradient)


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns of ``values`` (rounded to nearest, ties to even), as uint16.

    NaN stays NaN; values beyond bfloat16's range become infinities, which decoding
    refuses like any other non-finite value.
    """
    return wire_elements(values, "bfloat16")


def wire_elements(gradient: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """``gradient`` as the wire's elements, written into the bytes ``out`` where given:
    itself for float32 (no copy without ``out``), one compiled pass for 16-bit types
    (numpy's own conversions are several times slower: gemq/wire/halfprecision.py)."""
    if dtype not in ("bfloat16", "float16"):
        wire = WIRE_DTYPES[dtype]
        if out is None:
            return np.ascontiguousarray(gradient, dtype=wire)
        elements = out.view(wire)
        elements[:] = gradient.reshape(-1)
        return elements
    from gemq.wire import halfprecision  # compiled by numba: only senders of 16 bits pay for it

    if dtype == "bfloat16":
        return halfprecision.to_bfloat16_bits(gradient, out)
    return halfprecision.to_float16(gradient, out)


def _read_header(message: Message) -> tuple[list[object], int]:
    # Only the header's possible extent is fed: the unpacker copies what it is given, and
    # the payload after it is megabytes.
    prefix = memoryview(message)[:_HEADER_MAX_BYTES]
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(prefix) or 1,
                                max_array_len=_HEADER_FIELDS, max_map_len=0,
                                max_str_len=256, max_bin_len=0, strict_map_key=True)
    unpacker.feed(prefix)
    try:
        header = unpacker.unpack()
    except Exception as e:  # msgpack raises a zoo of types on garbage; all mean one thing
        raise CodecError(MALFORMED, f"header is not valid msgpack ({type(e).__name__})") from e
    if not isinstance(header, list) or len(header) not in (_LEGACY_HEADER_FIELDS,
                                                           _HEADER_FIELDS):
        raise CodecError(MALFORMED, "header is not an array of 8 or 9 fields")
    if len(header) == _LEGACY_HEADER_FIELDS:
        header.append(None)
    elif header[-1] is not None and not _is_number(header[-1]):
        raise CodecError(MALFORMED, f"header's 9th field {header[-1]!r} is not an accuracy")
    return header, unpacker.tell()


def _check_header(header: list[object], expected: Expected) -> dict[str, Any]:
    fmt, run_id, worker_id, version, samples, loss, dtype, layout_id, accuracy = header
    if not _is_int(fmt, FORMAT_VERSION, FORMAT_VERSION):
        raise CodecError(BAD_FORMAT, f"format version {fmt!r}, this reader speaks "
                                     f"{FORMAT_VERSION}")
    if not isinstance(worker_id, str) or not is_valid_worker_id(worker_id):
        raise CodecError(BAD_HEADER, f"worker id {worker_id!r} is not a valid id")
    if not _is_int(version, 0, _MAX_VERSION) or not _is_int(samples, 1, 2**31):
        raise CodecError(BAD_HEADER, f"param_version {version!r} or samples {samples!r} "
                                     "out of range")
    if not _is_number(loss):
        raise CodecError(BAD_HEADER, f"loss {loss!r} is not a number")
    if not math.isfinite(loss):  # the training diverged: a worker's loss, not a foreign writer
        raise CodecError(NON_FINITE, f"loss is {loss!r}")
    if accuracy is not None and not (_is_number(accuracy) and 0.0 <= accuracy <= 1.0):
        raise CodecError(BAD_HEADER, f"accuracy {accuracy!r} is not within [0, 1]")
    if run_id != expected.run_id:
        raise CodecError(WRONG_RUN, f"message for run {run_id!r}, expected "
                                    f"{expected.run_id!r}")
    if layout_id != expected.layout_id:
        raise CodecError(WRONG_LAYOUT, f"layout {layout_id!r}, expected {expected.layout_id!r}")
    if dtype != expected.dtype:
        raise CodecError(WRONG_DTYPE, f"dtype {dtype!r}, this run expects {expected.dtype!r}")
    return {"run_id": run_id, "worker_id": worker_id, "param_version": version,
            "samples": samples, "loss": float(loss), "dtype": dtype, "layout_id": layout_id,
            "accuracy": None if accuracy is None else float(accuracy)}


def _refuse_values(gradient: np.ndarray) -> None:
    """Name why a gradient the bounds check refused is refused."""
    if not np.isfinite(gradient).all():
        raise CodecError(NON_FINITE, "gradient holds NaN or Inf")
    raise CodecError(OUT_OF_RANGE, f"gradient element beyond +-{MAX_ABS_GRADIENT:g}")


def _is_number(value: object) -> TypeGuard[float | int]:
    return isinstance(value, float | int) and not isinstance(value, bool)


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


_BIN_HEADERS = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}


def _bin_header(length: int) -> bytes:
    """The msgpack bin header for ``length`` bytes, in msgpack's own (smallest) format."""
    for tag, length_format in _BIN_HEADERS.items():
        if length < 1 << (8 * struct.calcsize(length_format)):
            return bytes([tag]) + struct.pack(length_format, length)
    raise ValueError(f"a gradient of {length} bytes does not fit a msgpack bin")


def _read_bin(message: Message, offset: int) -> memoryview:
    """The msgpack bin object at ``offset``, as a view; it must end the message."""
    view = memoryview(message)
    if offset >= len(view) or view[offset] not in _BIN_HEADERS:
        raise CodecError(MALFORMED, "gradient payload is missing or not a msgpack bin")
    length_format = _BIN_HEADERS[view[offset]]
    start = offset + 1 + struct.calcsize(length_format)
    if start > len(view):
        raise CodecError(MALFORMED, "gradient payload header is truncated")
    (length,) = struct.unpack_from(length_format, view, offset + 1)
    if start + length != len(view):
        raise CodecError(MALFORMED, f"payload declares {length} bytes, message holds "
                                    f"{len(view) - start}")
    return view[start:start + length]
