"""Committed tuples on disk: {family: {axis: value}} as msgpack (or JSON, by extension).

A tuple file is data the tuner writes and a receipt names by hash; it holds no floats (pins and knobs are
integers, booleans or strings), so its canonical msgpack encoding is exact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack

from detent_audit.atomic import write_atomically
from detent_audit.errors import BadInput


def _check(data: Any, source: str) -> dict[str, dict[str, Any]]:
    if not isinstance(data, Mapping) or not all(isinstance(k, str) and isinstance(v, Mapping)
                                                for k, v in data.items()):
        raise BadInput(f"{source}: a tuple maps family names to {{axis: value}} maps")
    for family, axes in data.items():
        for axis, value in axes.items():
            if not isinstance(axis, str) or not isinstance(value, (int, bool, str)):
                raise BadInput(f"{source}: {family}.{axis} = {value!r}: values are integers, booleans or strings")
    return {f: dict(sorted(a.items())) for f, a in sorted(data.items())}


def load_tuple(path: str | Path) -> dict[str, dict[str, Any]]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BadInput(f"{path.name}: cannot read the tuple file ({exc.strerror})") from None
    try:
        data = json.loads(raw) if path.suffix == ".json" else msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadInput(f"{path.name}: not a tuple file ({exc})") from None
    return _check(data, path.name)


def encode_tuple(values: dict[str, dict[str, Any]]) -> bytes:
    """The canonical encoding (sorted keys) that `tuple_hash` hashes."""
    return msgpack.packb(_check(values, "tuple"), use_bin_type=True)


def tuple_hash(values: dict[str, dict[str, Any]]) -> str:
    return hashlib.sha256(encode_tuple(values)).hexdigest()


def save_tuple(values: dict[str, dict[str, Any]], path: str | Path) -> None:
    write_atomically(path, encode_tuple(values))
