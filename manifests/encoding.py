"""Canonical encodings: the one spelling of every signed or hashed byte string, and float bits.

- **Canonical msgpack** (`pack`, `freeze`, `thaw`): receipts, run manifests, envelopes. msgpack has no
  canonical form of its own (msgpack/msgpack#215 and #317), so this module fixes one, in the manner of
  Keybase's canonical msgpack: values are nil, bool, int in [-2**63, 2**64 - 1], UTF-8 str, bin, arrays and
  maps with str keys; **no floats** anywhere (a float travels as its IEEE-754 bits, `f64_to_bits`) and no ext
  types; every header has its shortest encoding (msgpack-python packs that way); map keys are sorted by
  their UTF-8 bytes (= Python str order) and unique.
- **Canonical JSON** (`canonical_json`): keys sorted, no whitespace, no NaN; what deployment facts, the
  selection cache's keys and a client's request body are hashed as. `facts_hash` and `tuple_hash` are the
  two digests a receipt names.
- **Bits**: IEEE-754 binary64 as u64, little-endian u32 and f32 arrays, SHA-256 hex.

Reading them back, bounded and strict, is `decoding.py`. Every failure raises the `error` class the caller
names (an `InvalidReceipt` subclass), never anything else.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import struct
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Union

import msgpack

from detent_audit.errors import BadInput
from detent_audit.manifests.errors import InvalidReceipt

MAX_DEPTH = 32  # nesting of maps and arrays; receipts need 5
INT_MIN, UINT64_MAX, UINT32_MAX = -(2**63), 2**64 - 1, 2**32 - 1

# a JSON document as read or written: facts, a client's request body, a statement, a report
JsonValue = Union[str, int, float, bool, None, list["JsonValue"], dict[str, "JsonValue"]]
# a committed tuple: family -> axis -> value (no floats, so its msgpack encoding is exact)
AxisValue = Union[int, bool, str]
TupleValues = dict[str, dict[str, AxisValue]]


# ---- encode -------------------------------------------------------------------------------------------


def pack(value: object, *, error: type[InvalidReceipt] = InvalidReceipt) -> bytes:
    """The canonical msgpack bytes of `value`; raises `error` naming the path of a value it cannot encode."""
    return msgpack.packb(_walk(value, "", 0, error, dict, list), use_bin_type=True)


def freeze(value: object, where: str, *, error: type[InvalidReceipt] = InvalidReceipt,
           allow_bytes: bool = True) -> object:
    """A validated, immutable copy: maps become read-only (keys sorted), arrays become tuples. With
    `allow_bytes=False` (facts, which are hashed as JSON), a bin value is refused too."""
    return _walk(value, where, 0, error, types.MappingProxyType, tuple, allow_bytes)


def thaw(value: object) -> object:
    """A plain copy of a canonical value (dicts and lists), e.g. for JSON or for a caller to modify."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def _walk(value: object, where: str, depth: int, error: type[InvalidReceipt],
          make_map: Callable[[dict[str, object]], object], make_list: Callable[[Iterator[object]], object],
          allow_bytes: bool = True) -> object:
    if depth > MAX_DEPTH:
        raise error(f"{where or 'value'}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, bytes) and not allow_bytes:
        raise error(f"{where or 'value'}: binary data is not a fact (facts are JSON values: their hash is "
                    "over canonical JSON)")
    if value is None or isinstance(value, (bool, bytes)):
        return value
    if isinstance(value, int):
        if not INT_MIN <= value <= UINT64_MAX:
            raise error(f"{where or 'value'}: integer {value} does not fit 64 bits")
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise error(f"{where or 'value'}: string is not valid Unicode text") from None
        return value
    if isinstance(value, float):
        raise error(f"{where or 'value'}: floats are not allowed in signed data (got {value!r}); "
                    "encode it as its IEEE-754 bits")
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for key in sorted(_check_keys(value, where, error)):
            path = f"{where}.{key}" if where else key
            out[key] = _walk(value[key], path, depth + 1, error, make_map, make_list, allow_bytes)
        return make_map(out)
    if isinstance(value, (list, tuple)):
        return make_list(_walk(v, f"{where}[{i}]", depth + 1, error, make_map, make_list, allow_bytes)
                         for i, v in enumerate(value))
    raise error(f"{where or 'value'}: {type(value).__name__} cannot be encoded")


def _check_keys(value: Mapping, where: str, error: type[InvalidReceipt]) -> list[str]:
    keys = list(value)
    for key in keys:
        if not isinstance(key, str):
            raise error(f"{where or 'value'}: map key {key!r} is not a string")
    return keys


# ---- IEEE-754 bits and digests -----------------------------------------------------------------------


def f64_to_bits(value: float) -> int:
    """The IEEE-754 binary64 bits of `value` as an unsigned int (exact for every float, -0.0 and NaNs)."""
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def f64_from_bits(bits: int) -> float:
    """The float whose binary64 bits are `bits` (an int in [0, 2**64 - 1])."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def u32le_pack(values: Iterable[int]) -> bytes:
    """Unsigned 32-bit ints as consecutive little-endian words (token ids)."""
    words = list(values)
    return struct.pack(f"<{len(words)}I", *words)


def u32le_unpack(data: bytes) -> tuple[int, ...]:
    """The ints of little-endian u32 words (len(data) must be a multiple of 4)."""
    return struct.unpack(f"<{len(data) // 4}I", data)


def f32le_pack(values: Iterable[float]) -> bytes:
    """Floats as consecutive little-endian binary32, each rounded to the nearest fp32."""
    floats = list(values)
    return struct.pack(f"<{len(floats)}f", *floats)


def f32le_unpack(data: bytes) -> tuple[float, ...]:
    """The floats of little-endian binary32 bytes (len(data) must be a multiple of 4)."""
    return struct.unpack(f"<{len(data) // 4}f", data)


def rfc3339_utc(unix_ns: int) -> str:
    """`unix_ns` (nanoseconds since the Unix epoch) as an RFC 3339 UTC time with nanoseconds, for people."""
    seconds, nanos = divmod(unix_ns, 10**9)
    utc = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return f"{utc:%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z"


def f64_view(value: float) -> dict[str, float | str]:
    """A float for people: its binary64 bits in hex, labelled, beside its value."""
    return {"f64_bits_hex": f"0x{f64_to_bits(value):016x}", "value": json_float(value)}


def json_float(value: float) -> float | str:
    """`value` for JSON: finite floats as numbers, others as the strings 'nan', 'inf', '-inf'."""
    return value if math.isfinite(value) else str(value)


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of `data`: the one spelling of every digest in receipts and manifests."""
    return hashlib.sha256(data).hexdigest()


# ---- canonical JSON and the digests a receipt names ------------------------------------------------


def _plain(value: object) -> dict:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def canonical_json(value: object, *, ascii: bool = True) -> bytes:
    """The canonical JSON bytes of `value`: keys sorted, no whitespace, NaN and infinities refused, floats as
    Python writes them (the shortest text that reads back the same double); read-only mappings (a decoded
    receipt's) as objects, tuples as arrays. `ascii`: other characters as \\u escapes (facts, cache keys);
    else UTF-8 (a client's request body, as the client computes it). Raises `TypeError` or `ValueError` for a
    value that has no JSON form."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ascii, allow_nan=False,
                      default=_plain).encode("utf-8")


def facts_hash(facts: object) -> str:
    """SHA-256 hex of the facts' canonical (ASCII) JSON: a receipt's `deployment.hash`."""
    return sha256_hex(canonical_json(facts))


def check_tuple(data: object, source: str) -> TupleValues:
    """A committed tuple ({family: {axis: value}}, values int, bool or str) with keys sorted; else
    `BadInput`."""
    if not isinstance(data, Mapping) or not all(isinstance(k, str) and isinstance(v, Mapping)
                                                for k, v in data.items()):
        raise BadInput(f"{source}: a tuple maps family names to {{axis: value}} maps")
    for family, axes in data.items():
        for axis, value in axes.items():
            if not isinstance(axis, str) or not isinstance(value, (int, bool, str)):
                raise BadInput(f"{source}: {family}.{axis} = {value!r}: values are integers, booleans or "
                               "strings")
            if isinstance(value, int) and not INT_MIN <= value <= UINT64_MAX:
                raise BadInput(f"{source}: {family}.{axis} = {value}: does not fit 64 bits")
    return {f: dict(sorted(a.items())) for f, a in sorted(data.items())}


def encode_tuple(values: object) -> bytes:
    """A tuple's canonical msgpack (it holds no floats, so the encoding is exact): what `tuple_hash`
    hashes."""
    return pack(check_tuple(values, "tuple"))


def tuple_hash(values: object) -> str:
    """SHA-256 hex of `encode_tuple`: a receipt's `tuple.hash`."""
    return sha256_hex(encode_tuple(values))
