"""Canonical msgpack: the one encoding of every signed byte string (receipts, run manifests, envelopes).

msgpack has no canonical form of its own (msgpack/msgpack#215 and #317), so this module
fixes one, in the manner of Keybase's canonical msgpack:

- values are nil, bool, int in [-2**63, 2**64 - 1], UTF-8 str, bin, arrays and maps with str keys;
  **no floats** anywhere (a float travels as its IEEE-754 bits, `f64_to_bits`) and no ext types;
- every int, str, bin, array and map header has its shortest encoding (msgpack-python packs that way);
- map keys are sorted by their UTF-8 bytes (= Python str order) and unique.

`pack` emits that form. Decoding is bounded and strict: `read_bounded` checks a file's size before reading
it, `unpack` sets msgpack's per-container limits so no declared length is allocated before it is checked,
accepts exactly one object and no trailing bytes. Canonicity itself is checked by the callers, which
re-encode the object they built and require the exact input bytes (`Receipt.from_bytes`).

Every failure raises the `error` class the caller names (an `InvalidReceipt` subclass), never anything else.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import math
import os
import stat
import struct
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from detent_audit.manifests.errors import InvalidReceipt

MAX_DEPTH = 32  # nesting of maps and arrays; receipts need 5
INT_MIN, UINT64_MAX, UINT32_MAX = -(2**63), 2**64 - 1, 2**32 - 1
HEX_DIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Limits:
    """Upper bounds checked before anything of that size is allocated: the whole input, and each container."""

    max_bytes: int
    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int


# ---- encode -------------------------------------------------------------------------------------------


def pack(value: Any, *, error: type[InvalidReceipt] = InvalidReceipt) -> bytes:
    """The canonical msgpack bytes of `value`; raises `error` naming the path of a value it cannot encode."""
    return msgpack.packb(_walk(value, "", 0, error, dict, list), use_bin_type=True)


def freeze(value: Any, where: str, *, error: type[InvalidReceipt] = InvalidReceipt) -> Any:
    """A validated, immutable copy: maps become read-only (keys sorted), arrays become tuples."""
    return _walk(value, where, 0, error, types.MappingProxyType, tuple)


def thaw(value: Any) -> Any:
    """A plain copy of a canonical value (dicts and lists), e.g. for JSON or for a caller to modify."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def _walk(value: Any, where: str, depth: int, error: type[InvalidReceipt], make_map: Any, make_list: Any
          ) -> Any:
    if depth > MAX_DEPTH:
        raise error(f"{where or 'value'}: nested deeper than {MAX_DEPTH} levels")
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
        out = {}
        for key in sorted(_check_keys(value, where, error)):
            path = f"{where}.{key}" if where else key
            out[key] = _walk(value[key], path, depth + 1, error, make_map, make_list)
        return make_map(out)
    if isinstance(value, (list, tuple)):
        return make_list(_walk(v, f"{where}[{i}]", depth + 1, error, make_map, make_list)
                         for i, v in enumerate(value))
    raise error(f"{where or 'value'}: {type(value).__name__} cannot be encoded")


def _check_keys(value: Mapping, where: str, error: type[InvalidReceipt]) -> list[str]:
    keys = list(value)
    for key in keys:
        if not isinstance(key, str):
            raise error(f"{where or 'value'}: map key {key!r} is not a string")
    return keys


# ---- decode -------------------------------------------------------------------------------------------


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for reading, without blocking, and only if it is a regular file (else `OSError`)."""
    nonblock = getattr(os, "O_NONBLOCK", 0)  # POSIX: a FIFO's open would otherwise wait for a writer
    fd = os.open(path, os.O_RDONLY | nonblock)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if nonblock:  # (Windows has no O_NONBLOCK, and its set_blocking takes pipes only)
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | Path, max_bytes: int, *, what: str,
                 error: type[InvalidReceipt] = InvalidReceipt) -> bytes:
    """The bytes of the file at `path`, refused before reading when larger than `max_bytes` or not a regular
    file (a FIFO or a device would block the open or the read)."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise error(f"{path}: {size} bytes is larger than any {what} ({max_bytes} bytes at most)")
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:  # the file grew after fstat
        raise error(f"{path}: larger than any {what} ({max_bytes} bytes at most)")
    return data


def unpack(data: bytes, limits: Limits, *, what: str, error: type[InvalidReceipt] = InvalidReceipt) -> Any:
    """Decode exactly one msgpack object filling all of `data`, within `limits`.

    Returns plain dicts, lists, str, bytes, ints, bools and None (floats are refused by the schema checks of
    the caller). Raises `error` for a size over the limits, truncation, trailing bytes or any malformation.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise error(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise error(f"{what}: {len(data)} bytes is larger than the limit ({limits.max_bytes} bytes)")
    unpacker = msgpack.Unpacker(
        raw=False, use_list=True, strict_map_key=True, max_buffer_size=max(len(data), 1),
        max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len, max_array_len=limits.max_array_len,
        max_map_len=limits.max_map_len, max_ext_len=0,
    )
    try:
        unpacker.feed(data)
        value = unpacker.unpack()
        end = unpacker.tell()
    except msgpack.OutOfData:
        raise error(f"{what}: truncated (it declares more than its {len(data)} bytes)") from None
    except Exception as exc:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, StackError, ...
        raise error(f"{what}: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if end != len(data):
        raise error(f"{what}: {len(data) - end} trailing bytes after the encoded value")
    return value


def fields(value: Any, names: tuple[str, ...], where: str, *, error: type[InvalidReceipt] = InvalidReceipt
           ) -> dict[str, Any]:
    """`value` as a dict with exactly the keys `names`; unknown, extra or missing keys raise `error`."""
    if not isinstance(value, dict):
        raise error(f"{where}: expected a map, got {describe(value)}")
    missing, extra = sorted(set(names) - set(value)), sorted(set(value) - set(names), key=repr)
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(map(str, extra))}"] if extra else [])
        raise error(f"{where}: {'; '.join(parts)} (expected exactly: {', '.join(sorted(names))})")
    return value


# ---- checks shared by the schemas -------------------------------------------------------------------


def check_uint(value: Any, where: str, maximum: int = UINT64_MAX, minimum: int = 0, *,
               error: type[InvalidReceipt] = InvalidReceipt) -> int:
    """`value` if it is an int (not a bool) in [minimum, maximum], else raise `error`."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise error(f"{where}: expected an integer in [{minimum}, {maximum}], got {describe(value)}")
    return value


def check_str(value: Any, where: str, max_len: int, *, min_len: int = 1,
              error: type[InvalidReceipt] = InvalidReceipt) -> str:
    """`value` if it is a str of min_len..max_len characters, else raise `error`."""
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise error(f"{where}: expected a string of {min_len} to {max_len} characters, got {describe(value)}")
    return value


def check_digest(value: Any, where: str, *, error: type[InvalidReceipt] = InvalidReceipt) -> str:
    """`value` if it is a SHA-256 digest as 64 lowercase hex digits, else raise `error`."""
    if not isinstance(value, str) or len(value) != 64 or not HEX_DIGITS.issuperset(value):
        raise error(f"{where}: expected a SHA-256 digest as 64 lowercase hex digits, got {describe(value)}")
    return value


def check_token_ids(value: Any, where: str, max_len: int, *, min_len: int = 0,
                    error: type[InvalidReceipt] = InvalidReceipt) -> tuple[int, ...]:
    """`value` as a tuple of token ids (ints in [0, 2**32 - 1]), min_len..max_len of them."""
    if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
        raise error(f"{where}: expected {min_len} to {max_len} token ids, got {describe(value)}")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= UINT32_MAX:
            raise error(f"{where}[{i}]: expected a token id in [0, 2**32 - 1], got {describe(token)}")
    return tuple(value)


def describe(value: Any) -> str:
    if isinstance(value, (list, tuple, dict, bytes, str)) and len(value) > 8:
        return f"{type(value).__name__} of length {len(value)}"
    return f"{type(value).__name__} {value!r}"


# ---- IEEE-754 bits and digests -----------------------------------------------------------------------


def f64_to_bits(value: float) -> int:
    """The IEEE-754 binary64 bits of `value` as an unsigned int (exact for every float, -0.0 and NaNs)."""
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def f64_from_bits(bits: int) -> float:
    """The float whose binary64 bits are `bits` (an int in [0, 2**64 - 1])."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def f32le_pack(values: Any) -> bytes:
    """Floats as consecutive little-endian binary32, each rounded to the nearest fp32."""
    values = list(values)
    return struct.pack(f"<{len(values)}f", *values)


def f32le_unpack(data: bytes) -> tuple[float, ...]:
    """The floats of little-endian binary32 bytes (len(data) must be a multiple of 4)."""
    return struct.unpack(f"<{len(data) // 4}f", data)


def rfc3339_utc(unix_ns: int) -> str:
    """`unix_ns` (nanoseconds since the Unix epoch) as an RFC 3339 UTC time with nanoseconds, for people."""
    seconds, nanos = divmod(unix_ns, 10**9)
    utc = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return f"{utc:%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z"


def f64_view(value: float) -> dict[str, Any]:
    """A float for people: its binary64 bits in hex, labelled, beside its value."""
    return {"f64_bits_hex": f"0x{f64_to_bits(value):016x}", "value": json_float(value)}


def json_float(value: float) -> float | str:
    """`value` for JSON: finite floats as numbers, others as the strings 'nan', 'inf', '-inf'."""
    return value if math.isfinite(value) else str(value)


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of `data`: the one spelling of every digest in receipts and manifests."""
    return hashlib.sha256(data).hexdigest()
