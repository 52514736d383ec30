"""Committed tuples on disk: {family: {axis: value}} as msgpack (or JSON, by extension).

A tuple file is data the tuner writes and a receipt names by hash; it holds no floats (pins and knobs are
integers, booleans or strings), so its canonical msgpack encoding is exact (`manifests.encoding.tuple_hash`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import msgpack

from detent_audit.atomic import write_atomically
from detent_audit.errors import BadInput
from detent_audit.manifests.encoding import TupleValues, check_tuple, encode_tuple


def load_tuple(path: str | Path) -> TupleValues:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BadInput(f"{path.name}: cannot read the tuple file ({exc.strerror})") from None
    try:
        if path.suffix == ".json":
            data = json.loads(raw)
        else:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadInput(f"{path.name}: not a tuple file ({exc})") from None
    return check_tuple(data, path.name)


def save_tuple(values: Mapping[str, Mapping[str, object]], path: str | Path) -> None:
    write_atomically(path, encode_tuple(values))
