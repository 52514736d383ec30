"""Fuzz what verify reads first: mutated receipts and run manifests (bit flips, truncations, re-signed payload
edits, type swaps, bombs of nesting, width and size) through the envelope, signature and payload decoders,
under a memory cap. Every case must end in a named error of the project (or decode into a well-formed
document of other content, counted apart): a crash, a traceback or a foreign exception is a failure.

    python benchmarks/fuzz_verify.py --cases 20000 --memory-gib 1 --json OUT.json

The cap is `RLIMIT_AS`, set in a child process before any case runs (the child imports no torch). Prints and
writes: counts per outcome (error class), time per case (p50, p99, max), peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from detent_audit.errors import DetentError
from detent_audit.manifests.dsse import (
    RECEIPT_PAYLOAD_TYPE,
    RUN_MANIFEST_PAYLOAD_TYPE,
    Envelope,
    sign_envelope,
)
from detent_audit.manifests.keys import keyid
from detent_audit.manifests.receipt import sign_receipt, verify_envelope
from detent_audit.manifests.run_manifest import RunManifest, sign_run_manifest, verify_run_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' random receipts
import receipt_samples  # noqa: E402

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
TRUSTED = {keyid(KEY.public_key()): KEY.public_key()}


def _flip(data: bytes, rng: random.Random, n: int) -> bytes:
    b = bytearray(data)
    for _ in range(n):
        i = rng.randrange(len(b) * 8)
        b[i // 8] ^= 1 << (i % 8)
    return bytes(b)


def _resign(payload: bytes, kind: str) -> bytes:
    return sign_envelope(RECEIPT_PAYLOAD_TYPE if kind == "receipt" else RUN_MANIFEST_PAYLOAD_TYPE, payload,
                         KEY).to_bytes()


def _mutate_wire(w: Any, rng: random.Random) -> Any:
    """One random edit somewhere in a decoded document: a type swap, a huge or negative int, a deletion, an
    extra key, a deep or wide value."""
    path = []
    node = w
    while isinstance(node, (dict, list)) and node and rng.random() < 0.75:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return rng.choice([[], {}, None, 0, "x", b"x"])
    parent, key = path[-1]
    choice = rng.randrange(9)
    if choice == 0 and isinstance(parent, dict):
        del parent[key]
    elif choice == 1 and isinstance(parent, dict):
        parent[f"extra{rng.randrange(9)}"] = rng.choice([1, "x", [1], {"a": 1}])
    else:
        parent[key] = rng.choice([None, True, -1, 2**64 - 1, -2**63, "", "A" * 64,
                                  b"\x00" * rng.randint(0, 40),
                                  [1, 2], {"k": 1}, [[[[]]]] * 3, "0" * 64, 1.5, rng.getrandbits(32)])
    return w


def _nested(depth: int, opener: bytes = b"\x91", leaf: bytes = b"\xc0") -> bytes:
    return opener * depth + leaf


def bomb(rng: random.Random, max_size: int = 60 << 20) -> tuple[str, bytes]:
    """A decoder bomb, as an envelope (before the signature) or as a signed payload (after it), of up to
    `max_size` bytes."""
    size = rng.choice([s for s in (1 << 10, 1 << 16, 1 << 20, 20 << 20, 60 << 20) if s <= max_size])
    kind = rng.randrange(10)
    if kind == 0:
        name, body = "nested-arrays", _nested(min(size, 1 << 20))
    elif kind == 1:
        name, body = "nested-maps", b"\x81\xa1k" * (size // 3) + b"\xc0"
    elif kind == 2:  # one wide array of empty arrays
        n = size - 5
        name, body = "wide-empty-arrays", b"\xdd" + struct.pack(">I", n) + b"\x90" * n
    elif kind == 3:  # fixarrays of 15 nested, the whole file
        name, body = "fixarray15-tree", b"\x9f" * size
    elif kind == 4:
        name, body = "declared-4gib-bin", b"\xc6\xff\xff\xff\xff" + rng.randbytes(64)
    elif kind == 5:
        name, body = "declared-4gib-map", b"\xdf\xff\xff\xff\xff" + b"\xa1k\xc0" * 100
    elif kind == 6:  # a map of many short keys
        n = min(size // 4, 1 << 22)
        name, body = "wide-map", b"\xdf" + struct.pack(">I", n) + b"".join(
            b"\xa2" + struct.pack(">H", i & 0xFFFF) + b"\xc0" for i in range(min(n, 1 << 16)))
    elif kind == 7:  # a receipt whose client body is a JSON bomb
        r = receipt_samples.random_receipt(rng, KEY)
        json_bomb = rng.choice([b"[" * (1 << 16) + b"]" * (1 << 16),
                                b"[" + b"[]," * ((8 << 20) // 3) + b"[]]",
                                b'{"a":' * 5000 + b"1" + b"}" * 5000])
        w = msgpack.unpackb(r.to_bytes(), raw=False)
        w["request"]["client"]["body_json"] = json_bomb[: 16 << 20]
        import hashlib

        client = w["request"]["client"]
        client["body_sha256"] = hashlib.sha256(client["body_json"]).hexdigest()
        return "json-bomb-in-client-body", _resign(msgpack.packb(w, use_bin_type=True), "receipt")
    elif kind == 8:
        name, body = "many-strings", b"\xdd" + struct.pack(">I", (size - 5)) + b"\xa0" * (size - 5)
    else:
        name, body = "deep-in-facts", None
        r = receipt_samples.random_receipt(rng, KEY)
        w = msgpack.unpackb(r.to_bytes(), raw=False)
        deep: Any = 1
        for _ in range(rng.choice([40, 1000])):
            deep = [deep]
        w["deployment"]["facts"]["x"] = deep
        return name, _resign(msgpack.packb(w, use_bin_type=True), "receipt")
    if rng.random() < 0.5:
        return f"{name}-envelope", body  # before the signature
    kind = rng.choice(["receipt", "manifest"])
    return f"{name}-signed-{kind}", _resign(body, kind)


def corpus(rng: random.Random) -> dict[str, list[bytes]]:
    receipts = receipt_samples.random_run(rng, 16, KEY, run_id="run")
    manifest = RunManifest.for_receipts(receipts, run_id="run", node_keyid=receipts[0].node_keyid,
                                        deployment_hash=receipts[0].deployment_hash,
                                        tuple_hash=receipts[0].tuple_hash,
                                        time_unix_ns=receipts[0].time_unix_ns)
    return {"receipt": [sign_receipt(r, KEY) for r in receipts],
            "manifest": [sign_run_manifest(manifest, KEY)]}


def make_case(rng: random.Random, base: dict[str, list[bytes]]) -> tuple[str, str, bytes]:
    """(mutation, document kind it is read as, bytes)."""
    kind = rng.choice(["receipt", "receipt", "manifest"])
    data = rng.choice(base[kind])
    m = rng.randrange(8)
    if m == 0:
        return "bit-flips", kind, _flip(data, rng, rng.randint(1, 8))
    if m == 1:
        return "truncated", kind, data[: rng.randrange(len(data))]
    if m == 2:
        return "extended", kind, data + rng.randbytes(rng.randint(1, 64))
    payload = Envelope.from_bytes(data).payload
    if m == 3:
        return "resigned-payload-flips", kind, _resign(_flip(payload, rng, rng.randint(1, 4)), kind)
    if m == 4:
        w = _mutate_wire(msgpack.unpackb(payload, raw=False), rng)
        try:
            packed = msgpack.packb(w, use_bin_type=True)
        except (TypeError, ValueError):
            packed = payload
        return "resigned-field-edit", kind, _resign(packed, kind)
    if m == 5:
        name, body = bomb(rng)
        return f"bomb:{name}", kind, body
    if m == 6:
        return "random-bytes", kind, rng.randbytes(rng.randint(0, 4096))
    other = "manifest" if kind == "receipt" else "receipt"
    return "wrong-document-kind", other, data


def read(kind: str, data: bytes) -> str:
    """What verify does with the bytes before any engine: envelope, signature, payload, client body, JSON
    view. Returns 'decoded' for a well-formed document; raises the project's named errors."""
    if kind == "receipt":
        receipt = verify_envelope(data, TRUSTED).receipt
        receipt.request.client.body()
        receipt.to_json()
    else:
        verify_run_manifest(data, TRUSTED).manifest.to_json()
    return "decoded"


def run_cases(n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    base = corpus(rng)
    outcomes: Counter[str] = Counter()
    by_mutation: dict[str, Counter[str]] = {}
    times: list[float] = []
    crashes: list[dict[str, str]] = []
    slowest: tuple[float, str] = (0.0, "")
    for i in range(n):
        mutation, kind, data = make_case(rng, base)
        start = time.perf_counter()
        try:
            outcome = read(kind, data)
        except DetentError as exc:
            outcome = type(exc).__name__
        except BaseException as exc:  # noqa: BLE001 (what the fuzz exists to find)
            outcome = f"CRASH {type(exc).__name__}"
            crashes.append({"case": str(i), "mutation": mutation, "error": repr(exc)[:300],
                            "traceback": traceback.format_exc()[-2000:]})
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        slowest = max(slowest, (elapsed, mutation))
        outcomes[outcome] += 1
        by_mutation.setdefault(mutation.split(":")[0] if not mutation.startswith("bomb") else mutation,
                               Counter())[outcome] += 1
        del data
    times.sort()
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))]  # noqa: E731
    return {"cases": n, "seed": seed, "outcomes": dict(outcomes), "crashes": len(crashes),
            "crash_examples": crashes[:5],
            "by_mutation": {k: dict(v) for k, v in sorted(by_mutation.items())},
            "time_s": {"p50": q(0.5), "p99": q(0.99), "max": times[-1], "total": sum(times),
                       "slowest_mutation": slowest[1]},
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child(n: int, seed: int, memory_gib: float) -> None:
    cap = int(memory_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    result = run_cases(n, seed)
    result["memory_cap_bytes"] = cap
    print(json.dumps(result))


def run_capped(n: int, seed: int, memory_gib: float, timeout: float | None = None) -> dict[str, Any]:
    """`run_cases` in a child process under RLIMIT_AS = memory_gib (a MemoryError there would be a crash)."""
    proc = subprocess.run([sys.executable, __file__, "--child", "--cases", str(n), "--seed", str(seed),
                           "--memory-gib", str(memory_gib)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the fuzz child exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-gib", type=float, default=1.0)
    ap.add_argument("--json", type=Path, default=None, help="Write the result here.")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.cases, args.seed, args.memory_gib)
        return 0
    result = run_capped(args.cases, args.seed, args.memory_gib)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(f"{result['cases']} cases under a {args.memory_gib} GiB cap: {result['crashes']} crashes; outcomes "
          f"{result['outcomes']}; p50 {result['time_s']['p50'] * 1e3:.2f} ms, p99 "
          f"{result['time_s']['p99'] * 1e3:.2f} "
          f"ms, max {result['time_s']['max'] * 1e3:.1f} ms ({result['time_s']['slowest_mutation']}); peak "
          "RSS "
          f"{result['peak_rss_mib']:.0f} MiB")
    return 1 if result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
