"""Run manifests: one signature over all the receipts of a run (an evaluation, a batch job), as a Merkle root.

A receipt's digest is SHA-256 of its payload bytes (`Receipt.digest`): what the node signed, independent of
the envelope around it. A manifest lists the digests of its run's receipts **sorted ascending and unique**:
the set is what a run produced, while the order receipts finished in depends on scheduling, which a
batch-invariant node keeps out of every output bit. The root is RFC 6962's Merkle tree hash over that list:

    leaf(d)     = SHA-256(0x00 || d)             d: the 32 raw digest bytes
    node(l, r)  = SHA-256(0x01 || l || r)
    root(D[n])  = leaf(D[0]) for n = 1; node(root(D[0:k]), root(D[k:n])) for n > 1, k the largest power of
                  two < n; SHA-256(b"") for n = 0

Built level by level, this is pairing neighbours and promoting an odd last node unchanged (never
duplicating it, so no two lists share a root). The payload (canonical msgpack, version 2):

    {deployment_hash: hex, kind: "rotation"|"final"|"recovery", merkle_root: hex, node_keyid: hex,
     output_tokens: u64, prompt_tokens: u64, receipt_count: uint, receipt_digests: [hex], run_id: str,
     seq_first: u64, seq_last: u64, time_unix_ns: u64, tuple_hash: hex, version: 2}

`merkle_root` and `receipt_count` are derived from the list; decoding requires them to match it.

Coverage: every receipt names its run and its sequence number in it (`Receipt.run`). A manifest covers the
receipts of run `run_id` whose sequence numbers lie in [seq_first, seq_last]: a `rotation` manifest (every
`--rotate` receipts) and the `final` one (written on a clean shutdown; no receipt of the run comes after
its seq_last) list every one of them, so receipt_count = seq_last - seq_first + 1; a `recovery` manifest is
written by the next process on the same folder for the receipts a killed run left uncovered (those present:
one may be missing at the end, the receipt being written when the process died, whose response never left).
A verifier of a folder requires every receipt present to be in a manifest of its run, and every manifest to
list every receipt present in its range (`coverage`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from detent_audit.manifests import decoding as dec
from detent_audit.manifests import dsse
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.errors import BadSignature, InvalidManifest, ManifestMismatch
from detent_audit.manifests.receipt import MAX_REQUEST_ID_LEN, Receipt

SCHEMA_VERSION = 2
KINDS = ("rotation", "final", "recovery")
MAX_RUN_RECEIPTS = 1 << 19  # 67 bytes each keeps a manifest under MAX_PAYLOAD_BYTES; split larger runs
_LIMITS = dec.Limits(max_bytes=dsse.MAX_PAYLOAD_BYTES, max_str_len=1024, max_bin_len=0,
                     max_array_len=MAX_RUN_RECEIPTS, max_map_len=16, max_objects=MAX_RUN_RECEIPTS + 64)
_FIELDS = ("deployment_hash", "kind", "merkle_root", "node_keyid", "output_tokens", "prompt_tokens",
           "receipt_count", "receipt_digests", "run_id", "seq_first", "seq_last", "time_unix_ns",
           "tuple_hash", "version")


def merkle_root(digests: Sequence[bytes]) -> bytes:
    """The RFC 6962 Merkle tree hash of `digests` (32-byte values, in the order given)."""
    if not digests:
        return hashlib.sha256(b"").digest()
    level = [hashlib.sha256(b"\x00" + d).digest() for d in digests]
    while len(level) > 1:
        paired = [hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest()
                  for i in range(0, len(level) - 1, 2)]
        level = paired + level[-1:] if len(level) % 2 else paired  # the odd last node is promoted
    return level[0]


@dataclass(frozen=True)
class RunManifest:
    """The receipts of one run by one node, deployment and tuple. Build with `for_receipts`, or directly.

    Invariants of one that exists: `receipt_digests` are SHA-256 hex, sorted ascending, unique, at most
    `MAX_RUN_RECEIPTS`; hashes and keyid are SHA-256 hex; counts are unsigned 64-bit.
    """

    run_id: str
    receipt_digests: tuple[str, ...]
    node_keyid: str
    deployment_hash: str
    tuple_hash: str
    prompt_tokens: int  # summed over the run's receipts
    output_tokens: int
    time_unix_ns: int  # when the manifest was made, nanoseconds since the Unix epoch, UTC
    kind: str = "final"
    seq_first: int = 0  # the receipts' sequence numbers it covers (module docstring)
    seq_last: int = 0

    def __post_init__(self) -> None:
        dec.check_str(self.run_id, "run_id", MAX_REQUEST_ID_LEN, error=InvalidManifest)
        digests = self.receipt_digests
        if not isinstance(digests, (list, tuple)) or len(digests) > MAX_RUN_RECEIPTS:
            raise InvalidManifest(f"receipt_digests: expected at most {MAX_RUN_RECEIPTS} digests, "
                                  f"got {dec.describe(digests)}")
        for i, digest in enumerate(digests):
            dec.check_digest(digest, f"receipt_digests[{i}]", error=InvalidManifest)
            if i and digests[i - 1] >= digest:
                raise InvalidManifest(f"receipt_digests[{i}]: digests must be sorted ascending and unique")
        object.__setattr__(self, "receipt_digests", tuple(digests))
        if self.kind not in KINDS:
            raise InvalidManifest(f"kind: expected one of {', '.join(KINDS)}, got {dec.describe(self.kind)}")
        for name in ("seq_first", "seq_last"):
            dec.check_uint(getattr(self, name), name, error=InvalidManifest)
        span = self.seq_last - self.seq_first + 1
        if span < 1 or (self.kind != "recovery" and len(self.receipt_digests) != span) \
                or len(self.receipt_digests) > span:
            raise InvalidManifest(f"seq_first {self.seq_first}, seq_last {self.seq_last}: a {self.kind} "
                                  f"manifest of {len(self.receipt_digests)} receipts cannot cover that range")
        for name in ("node_keyid", "deployment_hash", "tuple_hash"):
            dec.check_digest(getattr(self, name), name, error=InvalidManifest)
        for name in ("prompt_tokens", "output_tokens", "time_unix_ns"):
            dec.check_uint(getattr(self, name), name, error=InvalidManifest)

    @classmethod
    def for_receipts(cls, receipts: Iterable[Receipt], *, run_id: str, node_keyid: str, deployment_hash: str,
                     tuple_hash: str, time_unix_ns: int, kind: str = "final") -> RunManifest:
        """The manifest of `receipts`, each of which must name this run, node, deployment and tuple; it covers
        their sequence numbers' range."""
        receipts = list(receipts)
        if not receipts:
            raise InvalidManifest("a run manifest covers one receipt at least")
        for r in receipts:
            if (r.node_keyid, r.deployment_hash, r.tuple_hash, r.run.run_id) != \
                    (node_keyid, deployment_hash, tuple_hash, run_id):
                raise InvalidManifest(f"receipt {r.digest} (request {r.request.request_id!r}) is from "
                                      "another run, node, deployment or tuple than the manifest",
                                      remedy="make one manifest per run")
        digests = sorted({r.digest for r in receipts})
        if len(digests) != len(receipts):
            raise InvalidManifest("the same receipt is listed twice", remedy="pass each receipt once")
        seqs = [r.run.seq for r in receipts]
        return cls(run_id, tuple(digests), node_keyid, deployment_hash, tuple_hash,
                   sum(len(r.request.prompt_token_ids) for r in receipts),
                   sum(len(r.output.token_ids) for r in receipts), time_unix_ns, kind, min(seqs), max(seqs))

    @property
    def receipt_count(self) -> int:
        return len(self.receipt_digests)

    @cached_property
    def merkle_root(self) -> str:
        """Hex RFC 6962 root over the sorted receipt digests (module docstring)."""
        return merkle_root([bytes.fromhex(d) for d in self.receipt_digests]).hex()

    def to_bytes(self) -> bytes:
        """The canonical payload bytes (what the envelope signs)."""
        return enc.pack({
            "deployment_hash": self.deployment_hash, "kind": self.kind, "merkle_root": self.merkle_root,
            "node_keyid": self.node_keyid,
            "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
            "receipt_count": self.receipt_count, "receipt_digests": list(self.receipt_digests),
            "run_id": self.run_id, "seq_first": self.seq_first, "seq_last": self.seq_last,
            "time_unix_ns": self.time_unix_ns, "tuple_hash": self.tuple_hash, "version": SCHEMA_VERSION,
        }, error=InvalidManifest)

    @classmethod
    def from_bytes(cls, data: bytes) -> RunManifest:
        """Decode payload bytes; every problem (size, schema, root, non-canonical) is `InvalidManifest`."""
        w = dec.fields(dec.unpack(data, _LIMITS, what="run manifest payload", error=InvalidManifest), _FIELDS,
                       "run manifest", error=InvalidManifest)
        if dec.check_uint(w["version"], "version", error=InvalidManifest) != SCHEMA_VERSION:
            raise InvalidManifest(f"run manifest: schema version {w['version']} is not supported (this "
                                  f"detent-audit reads version {SCHEMA_VERSION})",
                                  remedy="use the detent-audit release the node ran")
        manifest = cls(w["run_id"], w["receipt_digests"], w["node_keyid"], w["deployment_hash"],
                       w["tuple_hash"], w["prompt_tokens"], w["output_tokens"], w["time_unix_ns"], w["kind"],
                       w["seq_first"], w["seq_last"])
        if w["receipt_count"] != manifest.receipt_count:
            raise InvalidManifest(f"receipt_count: {w['receipt_count']!r}, but there are "
                                  f"{manifest.receipt_count} digests")
        if w["merkle_root"] != manifest.merkle_root:
            raise InvalidManifest(f"merkle_root: {w['merkle_root']!r} is not the root of the listed digests "
                                  f"({manifest.merkle_root})")
        if manifest.to_bytes() != bytes(data):
            raise InvalidManifest("run manifest payload: not canonical msgpack (re-encoded, it differs)")
        return manifest

    def to_json(self, indent: int | None = 2) -> str:
        """A JSON view for people (not signed, not parsed back)."""
        return json.dumps({
            "format": f"detent-audit run manifest v{SCHEMA_VERSION}, JSON view (the signed form is msgpack)",
            "run_id": self.run_id, "kind": self.kind, "seq_first": self.seq_first, "seq_last": self.seq_last,
            "node_keyid": self.node_keyid,
            "deployment_hash_sha256": self.deployment_hash,
            "tuple_hash_sha256": self.tuple_hash,
            "time": {"unix_ns": self.time_unix_ns, "utc_rfc3339": enc.rfc3339_utc(self.time_unix_ns)},
            "receipt_count": self.receipt_count, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "merkle_root_rfc6962": self.merkle_root,
            "receipt_digests_sha256": list(self.receipt_digests),
        }, indent=indent)


class VerifiedManifest(NamedTuple):
    """A run manifest whose signature verified under the trusted key `keyid`."""

    manifest: RunManifest
    keyid: str


def sign_run_manifest(manifest: RunManifest, key: Ed25519PrivateKey) -> bytes:
    """The envelope file bytes of `manifest` signed by `key`, the key `manifest.node_keyid` must name."""
    envelope = dsse.sign_envelope(dsse.RUN_MANIFEST_PAYLOAD_TYPE, manifest.to_bytes(), key,
                             named_keyid=manifest.node_keyid, error=InvalidManifest)
    return envelope.to_bytes()


def verify_run_manifest(data: bytes, trusted_keys: Mapping[str, Ed25519PublicKey]) -> VerifiedManifest:
    """Verify a run-manifest file's bytes and decode it: signature first, payload after.

    Raises `InvalidManifest` (malformed), `UntrustedKey`, `BadSignature`. The receipts are checked
    separately, with `check_run`.
    """
    # (1)-(2): bounded envelope decode, signature by a trusted key, payload type (dsse.open_envelope)
    payload, signer = dsse.open_envelope(data, trusted_keys, dsse.RUN_MANIFEST_PAYLOAD_TYPE,
                                         error=InvalidManifest)
    # (3): the payload: bounded decode, schema, root, canonical re-encoding; it names its signer
    manifest = RunManifest.from_bytes(payload)
    if manifest.node_keyid != signer:
        raise BadSignature(f"the run manifest names node key {manifest.node_keyid}, but {signer} signed it")
    return VerifiedManifest(manifest, signer)


def check_run(manifest: RunManifest, receipts: Iterable[Receipt]) -> None:
    """Require `receipts` (already verified) to be exactly the manifest's run; raise `ManifestMismatch`.

    Recomputes the Merkle root from the receipts present and compares it with the manifest's; on a
    difference the error lists the `missing` and `extra` digests.
    """
    receipts = list(receipts)
    # step (5), first: every receipt is of this run, node, deployment and tuple, within the manifest's range
    for r in receipts:
        for name in ("node_keyid", "deployment_hash", "tuple_hash"):
            if getattr(r, name) != getattr(manifest, name):
                raise ManifestMismatch(f"receipt {r.digest} (request {r.request.request_id!r}): {name} is "
                                       f"{getattr(r, name)}, the run manifest's is {getattr(manifest, name)}")
        if r.run.run_id != manifest.run_id or not manifest.seq_first <= r.run.seq <= manifest.seq_last:
            raise ManifestMismatch(f"receipt {r.digest} (request {r.request.request_id!r}) is receipt "
                                   f"{r.run.seq} of run {r.run.run_id!r}, outside this manifest's "
                                   f"{manifest.seq_first}-{manifest.seq_last} of run {manifest.run_id!r}")
    # then the root of the receipts present
    present = sorted(r.digest for r in receipts)
    if len(set(present)) != len(present):
        raise ManifestMismatch("the same receipt was given twice", remedy="pass each receipt file once")
    root = merkle_root([bytes.fromhex(d) for d in present]).hex()
    if root != manifest.merkle_root:
        missing = tuple(sorted(set(manifest.receipt_digests) - set(present)))
        extra = tuple(sorted(set(present) - set(manifest.receipt_digests)))
        raise ManifestMismatch(f"the {len(present)} receipts present have Merkle root {root}, the "
                               f"manifest's {manifest.receipt_count} have {manifest.merkle_root}: "
                               f"{len(missing)} missing, {len(extra)} not in the manifest",
                               missing=missing, extra=extra)
    # then the counts
    prompt = sum(len(r.request.prompt_token_ids) for r in receipts)
    output = sum(len(r.output.token_ids) for r in receipts)
    if (prompt, output) != (manifest.prompt_tokens, manifest.output_tokens):
        raise ManifestMismatch(f"the receipts hold {prompt} prompt and {output} output tokens, the manifest "
                               f"says {manifest.prompt_tokens} and {manifest.output_tokens}")
