"""safetensors files in a canonical form, and the weights' identity: their tensors, not the container's bytes.

`write_canonical` writes a safetensors file whose bytes are a function of its tensors and metadata alone: the
header's JSON with sorted keys and no whitespace (padded with spaces to 8 bytes, as the format asks), the data
in tensor-name order. (safetensors' own writer emits `__metadata__` from a hash map, in an order that changes
from one call to the next.)

`tensor_lines` reads a file's header (bounded, every offset checked) and hashes each tensor's data; the
weights hash of a checkpoint (`weights_hash`) is the SHA-256 over the lines
`name<TAB>dtype<TAB>d0,d1,..<TAB>sha256(data)<LF>` of all its tensors in name order (UTF-8 byte order),
whatever file or shard holds them: the header's metadata, its key order, padding and the tensors' placement
carry no weight and change no hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from detent_audit.runtime.errors import BadCheckpoint

WEIGHTS_FORM = "tensors-sha256"  # the prefix of a weights hash of this form (older receipts: bare file bytes)
MAX_HEADER = 100 << 20  # safetensors' own bound on the header
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_CHUNK = 1 << 20


def _data(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, little-endian, row-major."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def write_canonical(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write `tensors` and `metadata` to the new file `path`, its bytes a function of them alone."""
    names = sorted(tensors, key=lambda n: n.encode())
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise BadCheckpoint(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("xb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in names:
            f.write(_data(tensors[name]))


def _header(path: Path, size: int, f) -> tuple[dict, int]:
    """The header of an open safetensors file and where its data starts; `BadCheckpoint` unless every tensor
    entry is well formed and within the file."""
    head = f.read(8)
    if len(head) < 8:
        raise BadCheckpoint(f"{path}: not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_HEADER, size - 8):
        raise BadCheckpoint(f"{path}: its header claims {n} bytes, beyond the file or {MAX_HEADER}")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadCheckpoint(f"{path}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise BadCheckpoint(f"{path}: its header is not a JSON object")
    data_size = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (not any(c in name for c in "\t\n") and isinstance(entry, dict)
              and entry.get("dtype") in ITEM_BYTES
              and isinstance(entry.get("shape"), list) and isinstance(entry.get("data_offsets"), list)
              and all(type(d) is int and d >= 0 for d in entry["shape"])
              and len(entry["data_offsets"]) == 2 and all(type(o) is int for o in entry["data_offsets"]))
        if not ok:
            raise BadCheckpoint(f"{path}: tensor {name!r} has no valid dtype, shape and data_offsets")
        begin, end = entry["data_offsets"]
        expected = math.prod(entry["shape"]) * ITEM_BYTES[entry["dtype"]]
        if not 0 <= begin <= end <= data_size or end - begin != expected:
            raise BadCheckpoint(f"{path}: tensor {name!r} has data_offsets {[begin, end]}, not {expected} "
                                f"bytes within the file's {data_size}")
    return header, 8 + n


def tensor_lines(path: Path) -> list[str]:
    """One line per tensor of the safetensors file `path`: name, dtype, shape, SHA-256 of its data."""
    size = path.stat().st_size
    lines = []
    with path.open("rb") as f:
        header, start = _header(path, size, f)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            f.seek(start + begin)
            h, left = hashlib.sha256(), end - begin
            while left:
                chunk = f.read(min(left, _CHUNK))
                if not chunk:
                    raise BadCheckpoint(f"{path}: truncated in tensor {name!r}")
                h.update(chunk)
                left -= len(chunk)
            lines.append(f"{name}\t{entry['dtype']}\t{','.join(map(str, entry['shape']))}\t{h.hexdigest()}\n")
    return lines


def weights_hash(lines: Iterable[str]) -> str:
    """The weights' identity from the tensor lines of every file of a checkpoint; `BadCheckpoint` for a tensor
    named twice."""
    by_name: dict[bytes, str] = {}
    for line in lines:
        name = line.split("\t", 1)[0].encode()
        if name in by_name:
            raise BadCheckpoint(f"the checkpoint holds tensor {name.decode()!r} twice")
        by_name[name] = line
    h = hashlib.sha256()
    for name in sorted(by_name):
        h.update(by_name[name].encode())
    return f"{WEIGHTS_FORM}:{h.hexdigest()}"
