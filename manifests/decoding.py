"""Bounded, strict decoding of canonical msgpack, and the checks the schemas share.

`read_bounded` checks a file's size before reading it (and opens only regular files); `unpack` accepts exactly
one object and no trailing bytes, with per-container limits so no declared length is allocated before it is
checked. It is a decoder of its own, iterative, with a depth limit and a budget of decoded objects, so no
input costs more than its limits (a "bomb" of nested or many empty containers is refused early). Canonicity
itself is checked by the callers, which re-encode the object they built (`encoding.pack`) and require the
exact input bytes (`Receipt.from_bytes`). Every failure raises the `error` class the caller names (an
`InvalidReceipt` subclass), never anything else.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from detent_audit.manifests.encoding import MAX_DEPTH, UINT32_MAX, UINT64_MAX
from detent_audit.manifests.errors import InvalidReceipt

HEX_DIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Limits:
    """Upper bounds checked before anything of that size is allocated: the whole input, and each container."""

    max_bytes: int
    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int
    max_objects: int = 1 << 16  # objects decoded in all (every container and scalar counts one)


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


def unpack(data: bytes, limits: Limits, *, what: str, error: type[InvalidReceipt] = InvalidReceipt) -> object:
    """Decode exactly one msgpack object filling all of `data`, within `limits`.

    A decoder of its own (no recursion, no allocation before a check): every container's declared length is
    checked against `limits` and against the bytes left (each element takes one byte at least) before its
    elements are read; nesting stops at `MAX_DEPTH`; the objects decoded in all are counted against
    `limits.max_objects`. So any input is refused in time and memory proportional to the smaller of its size
    and that budget, never to what it declares. Returns plain dicts, lists, str, bytes, ints, bools and None;
    floats, ext types, non-str map keys and repeated keys are refused. Raises `error`, never anything else.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise error(f"{what}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > limits.max_bytes:
        raise error(f"{what}: {len(data)} bytes is larger than the limit ({limits.max_bytes} bytes)")
    value, end = _Decoder(data, limits, what, error).run()
    if end != len(data):
        raise error(f"{what}: {len(data) - end} trailing bytes after the encoded value")
    return value


class _Decoder:
    """The iterative decoder behind `unpack`: a stack of open containers, one loop, bounded work."""

    def __init__(self, data: bytes, limits: Limits, what: str, error: type[InvalidReceipt]) -> None:
        self.data, self.limits, self.what, self.error = data, limits, what, error
        self.pos, self.objects = 0, 0

    def fail(self, message: str) -> InvalidReceipt:
        return self.error(f"{self.what}: {message} (at byte {self.pos})")

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.error(f"{self.what}: truncated (it declares more than its {len(self.data)} bytes)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def run(self) -> tuple[object, int]:
        stack: list[_Frame] = []
        while True:
            value = self.item(len(stack))
            if isinstance(value, _Open):
                if value.length == 0:
                    value = value.container
                else:
                    stack.append(_Frame(value.container, value.length))
                    continue
            while True:  # place the value in its container; close every container it completes
                if not stack:
                    return value, self.pos
                frame = stack[-1]
                container = frame.container
                if isinstance(container, list):
                    container.append(value)
                    frame.remaining -= 1
                elif frame.key is None:
                    if not isinstance(value, str):
                        raise self.fail(f"a map key must be a string, got {type(value).__name__}")
                    if value in container:
                        raise self.fail(f"the map key {value[:64]!r} appears twice")
                    frame.key = value
                    break
                else:
                    container[frame.key] = value
                    frame.key = None
                    frame.remaining -= 1
                if frame.remaining:
                    break
                stack.pop()
                value = container

    def item(self, depth: int) -> object:
        self.objects += 1
        if self.objects > self.limits.max_objects:
            raise self.fail(f"more than {self.limits.max_objects} objects")
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0xA0 <= b <= 0xBF:
            return self.text(b & 0x1F)
        if 0x90 <= b <= 0x9F:
            return self.open(depth, b & 0x0F, False)
        if 0x80 <= b <= 0x8F:
            return self.open(depth, b & 0x0F, True)
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b in (0xCC, 0xCD, 0xCE, 0xCF):
            return self.uint(1 << (b - 0xCC))
        if b in (0xD0, 0xD1, 0xD2, 0xD3):
            return int.from_bytes(self.take(1 << (b - 0xD0)), "big", signed=True)
        if b in (0xD9, 0xDA, 0xDB):
            return self.text(self.uint(1 << (b - 0xD9)))
        if b in (0xC4, 0xC5, 0xC6):
            n = self.uint(1 << (b - 0xC4))
            if n > self.limits.max_bin_len:
                raise self.fail(f"a binary of {n} bytes is longer than the limit ({self.limits.max_bin_len})")
            return self.take(n)
        if b in (0xDC, 0xDD):
            return self.open(depth, self.uint(2 if b == 0xDC else 4), False)
        if b in (0xDE, 0xDF):
            return self.open(depth, self.uint(2 if b == 0xDE else 4), True)
        if b in (0xCA, 0xCB):
            raise self.fail("floats are not allowed in signed data")
        raise self.fail(f"type byte 0x{b:02x} (an ext type or reserved) is not allowed")

    def text(self, n: int) -> str:
        if n > self.limits.max_str_len:
            raise self.fail(f"a string of {n} bytes is longer than the limit ({self.limits.max_str_len})")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string is not valid UTF-8") from None

    def open(self, depth: int, count: int, is_map: bool) -> _Open:
        if depth >= MAX_DEPTH:
            raise self.fail(f"nested deeper than {MAX_DEPTH} levels")
        limit = self.limits.max_map_len if is_map else self.limits.max_array_len
        if count > limit:
            raise self.fail(f"{'a map' if is_map else 'an array'} of {count} entries is longer than the "
                            f"limit ({limit})")
        if count * (2 if is_map else 1) > len(self.data) - self.pos:  # every element takes a byte at least
            raise self.error(f"{self.what}: truncated (it declares more than its {len(self.data)} bytes)")
        return _Open({} if is_map else [], count)


class _Open(NamedTuple):
    container: dict[str, object] | list[object]
    length: int


@dataclass
class _Frame:
    """An open container on the decoder's stack: its elements still to come, and a map's pending key."""

    container: dict[str, object] | list[object]
    remaining: int
    key: str | None = None


def fields(value: object, names: tuple[str, ...], where: str, *,
           error: type[InvalidReceipt] = InvalidReceipt, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """`value` as a dict with exactly the keys `names` (and any of `optional`, absent ones as None); unknown,
    extra or missing keys raise `error`. The values are unchecked (typed Any): the records built from them
    validate each on construction."""
    if not isinstance(value, dict):
        raise error(f"{where}: expected a map, got {describe(value)}")
    allowed = set(names) | set(optional)
    missing, extra = sorted(set(names) - set(value)), sorted(set(value) - allowed, key=repr)
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(map(str, extra))}"] if extra else [])
        raise error(f"{where}: {'; '.join(parts)} (expected exactly: {', '.join(sorted(names))}"
                    + (f"; optional: {', '.join(sorted(optional))})" if optional else ")"))
    return {**{k: None for k in optional}, **value}


# ---- checks shared by the schemas -------------------------------------------------------------------


def check_uint(value: object, where: str, maximum: int = UINT64_MAX, minimum: int = 0, *,
               error: type[InvalidReceipt] = InvalidReceipt) -> int:
    """`value` if it is an int (not a bool) in [minimum, maximum], else raise `error`."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise error(f"{where}: expected an integer in [{minimum}, {maximum}], got {describe(value)}")
    return value


def check_str(value: object, where: str, max_len: int, *, min_len: int = 1,
              error: type[InvalidReceipt] = InvalidReceipt) -> str:
    """`value` if it is a str of min_len..max_len characters, else raise `error`."""
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise error(f"{where}: expected a string of {min_len} to {max_len} characters, got {describe(value)}")
    return value


def check_digest(value: object, where: str, *, error: type[InvalidReceipt] = InvalidReceipt) -> str:
    """`value` if it is a SHA-256 digest as 64 lowercase hex digits, else raise `error`."""
    if not isinstance(value, str) or len(value) != 64 or not HEX_DIGITS.issuperset(value):
        raise error(f"{where}: expected a SHA-256 digest as 64 lowercase hex digits, got {describe(value)}")
    return value


def check_token_ids(value: object, where: str, max_len: int, *, min_len: int = 0,
                    error: type[InvalidReceipt] = InvalidReceipt) -> tuple[int, ...]:
    """`value` as a tuple of token ids (ints in [0, 2**32 - 1]), min_len..max_len of them."""
    if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
        raise error(f"{where}: expected {min_len} to {max_len} token ids, got {describe(value)}")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= UINT32_MAX:
            raise error(f"{where}[{i}]: expected a token id in [0, 2**32 - 1], got {describe(token)}")
    return tuple(value)


def describe(value: object) -> str:
    if isinstance(value, (list, tuple, dict, bytes, str)) and len(value) > 8:
        return f"{type(value).__name__} of length {len(value)}"
    return f"{type(value).__name__} {value!r}"
