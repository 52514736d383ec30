"""Receipt v1: what a serving node signs for every response, and how a verifier reads it back.

A `Receipt` that exists is well formed: every constructor validates types, ranges and sizes and raises
`InvalidReceipt`; `Receipt.from_bytes` turns every decode problem into `InvalidReceipt` too. The payload is
canonical msgpack (encoding.py), one map, schema version 1 (`version`):

    deployment:   {facts: map, hash: hex}    the deployment's canonical facts and their hash, as its producer
    tuple:        {hash: hex, values: map}   (Deployment.facts_hash, the tuner) computes them; only their
                                             form is checked here, the verifier recomputes them (design.md 7)
    request:      {id: str, prompt_token_ids: [u32], sampling: map, seed: u64}
    sampling:     {ignore_eos: bool, logprobs: uint|nil, max_tokens: uint, stop_token_ids: [u32],
                   temperature_f64_bits: u64, top_k: uint, top_p_f64_bits: u64}
    output:       {digest: hex, finish_reason: "length"|"stop", logprobs_f32le: bin(4n), token_ids: [u32]*n}
    node_keyid:   hex (SHA-256 of the signer's raw public key; must be the envelope's signer)
    time_unix_ns: u64 (nanoseconds since the Unix epoch, UTC)
    version:      1

Floats travel as IEEE-754 bits: temperature and top_p as the uint64 bits of their binary64 value (the exact
Python float the request carried: no rounding; -0.0 and NaN payloads kept); logprobs as little-endian
binary32, 4 bytes per output token, exactly as the engine's fp32 tensor held them. Hashes are lowercase hex.

output.digest = SHA-256(b"detent-audit/output/v1\\0" || u64le(n) || u32le(token_ids[0..n)) || logprobs_f32le)
A receipt's own digest (what run manifests list) is SHA-256 of its payload bytes (`Receipt.digest`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import MAX_PAYLOAD_BYTES, RECEIPT_PAYLOAD_TYPE, open_envelope, sign_envelope
from detent_audit.manifests.errors import BadSignature, InvalidReceipt

SCHEMA_VERSION = 1
MAX_TOKENS = 1 << 22  # prompt or output tokens per request
MAX_REQUEST_ID_LEN = 256
MAX_STOP_TOKENS = 1024
MAX_LOGPROBS = 1024  # top-n alternatives a request may ask for (the engine allows fewer)
FINISH_REASONS = ("length", "stop")
OUTPUT_DIGEST_TAG = b"detent-audit/output/v1\x00"
_LIMITS = enc.Limits(max_bytes=MAX_PAYLOAD_BYTES, max_str_len=64 * 1024, max_bin_len=4 * MAX_TOKENS,
                     max_array_len=MAX_TOKENS, max_map_len=4096)
_SAMPLING_FIELDS = ("ignore_eos", "logprobs", "max_tokens", "stop_token_ids", "temperature_f64_bits", "top_k",
                    "top_p_f64_bits")
_FIELDS = ("deployment", "node_keyid", "output", "request", "time_unix_ns", "tuple", "version")


@dataclass(frozen=True)
class SamplingRecord:
    """How the request's tokens were drawn (the engine's SamplingParams without the seed)."""

    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # an int is taken as the float it equals
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidReceipt(f"request.sampling.{name}: expected a float, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidReceipt(f"request.sampling.temperature: expected a finite float >= 0, "
                                 f"got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidReceipt(f"request.sampling.top_p: expected a float in (0, 1], got {self.top_p!r}")
        enc.check_uint(self.top_k, "request.sampling.top_k", enc.UINT32_MAX)
        enc.check_uint(self.max_tokens, "request.sampling.max_tokens", MAX_TOKENS, 1)
        stop = enc.check_token_ids(self.stop_token_ids, "request.sampling.stop_token_ids", MAX_STOP_TOKENS)
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidReceipt(f"request.sampling.ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            enc.check_uint(self.logprobs, "request.sampling.logprobs", MAX_LOGPROBS)

    @classmethod
    def from_params(cls, params: Any) -> SamplingRecord:
        """From the engine's `SamplingParams` (read by attribute, so this module never imports the engine)."""
        return cls(params.temperature, params.top_k, params.top_p, params.max_tokens,
                   tuple(params.stop_token_ids), params.ignore_eos, params.logprobs)

    def _to_wire(self) -> dict[str, Any]:
        return {"ignore_eos": self.ignore_eos, "logprobs": self.logprobs, "max_tokens": self.max_tokens,
                "stop_token_ids": list(self.stop_token_ids), "top_k": self.top_k,
                "temperature_f64_bits": enc.f64_to_bits(self.temperature),
                "top_p_f64_bits": enc.f64_to_bits(self.top_p)}

    @classmethod
    def _from_wire(cls, wire: Any) -> SamplingRecord:
        w = enc.fields(wire, _SAMPLING_FIELDS, "request.sampling")
        bits = {name: enc.check_uint(w[f"{name}_f64_bits"], f"request.sampling.{name}_f64_bits")
                for name in ("temperature", "top_p")}
        temperature, top_p = enc.f64_from_bits(bits["temperature"]), enc.f64_from_bits(bits["top_p"])
        return cls(temperature, w["top_k"], top_p, w["max_tokens"], w["stop_token_ids"], w["ignore_eos"],
                   w["logprobs"])


@dataclass(frozen=True)
class RequestRecord:
    """The request as the engine ran it: token ids, never text (a verifier re-runs ids, not a template)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingRecord
    seed: int  # unsigned 64-bit sampling seed, recorded also when greedy

    def __post_init__(self) -> None:
        enc.check_str(self.request_id, "request.id", MAX_REQUEST_ID_LEN)
        prompt = enc.check_token_ids(self.prompt_token_ids, "request.prompt_token_ids", MAX_TOKENS, min_len=1)
        object.__setattr__(self, "prompt_token_ids", prompt)
        if not isinstance(self.sampling, SamplingRecord):
            raise InvalidReceipt(f"request.sampling: expected a SamplingRecord, "
                                 f"got {enc.describe(self.sampling)}")
        enc.check_uint(self.seed, "request.seed")

    def _to_wire(self) -> dict[str, Any]:
        return {"id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
                "sampling": self.sampling._to_wire(), "seed": self.seed}

    @classmethod
    def _from_wire(cls, wire: Any) -> RequestRecord:
        w = enc.fields(wire, ("id", "prompt_token_ids", "sampling", "seed"), "request")
        return cls(w["id"], w["prompt_token_ids"], SamplingRecord._from_wire(w["sampling"]), w["seed"])


@dataclass(frozen=True)
class OutputRecord:
    """The response: output token ids, each token's fp32 logprob as little-endian bytes, why it stopped."""

    token_ids: tuple[int, ...]
    logprobs_f32le: bytes  # 4 bytes per output token
    finish_reason: str

    def __post_init__(self) -> None:
        tokens = enc.check_token_ids(self.token_ids, "output.token_ids", MAX_TOKENS)
        object.__setattr__(self, "token_ids", tokens)
        if not isinstance(self.logprobs_f32le, bytes) or len(self.logprobs_f32le) != 4 * len(self.token_ids):
            raise InvalidReceipt(f"output.logprobs_f32le: expected {4 * len(self.token_ids)} bytes (4 per "
                                 f"output token), got {enc.describe(self.logprobs_f32le)}")
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidReceipt(f"output.finish_reason: expected one of {', '.join(FINISH_REASONS)}, "
                                 f"got {self.finish_reason!r}")

    @classmethod
    def from_floats(cls, token_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str
                    ) -> OutputRecord:
        """From Python floats, each rounded to fp32 (from a tensor: `t.numpy().astype("<f4").tobytes()`)."""
        return cls(tuple(token_ids), enc.f32le_pack(logprobs), finish_reason)

    @property
    def logprobs(self) -> tuple[float, ...]:
        """The logprobs as floats (exact: every binary32 value is a binary64 value)."""
        return enc.f32le_unpack(self.logprobs_f32le)

    @cached_property
    def digest(self) -> str:
        """SHA-256 over a tag, the token count, the token ids (u32le), the logprobs (module docstring)."""
        n = len(self.token_ids)
        ids = struct.pack(f"<Q{n}I", n, *self.token_ids)
        return enc.sha256_hex(OUTPUT_DIGEST_TAG + ids + self.logprobs_f32le)

    def _to_wire(self) -> dict[str, Any]:
        return {"digest": self.digest, "finish_reason": self.finish_reason,
                "logprobs_f32le": self.logprobs_f32le, "token_ids": list(self.token_ids)}

    @classmethod
    def _from_wire(cls, wire: Any) -> OutputRecord:
        w = enc.fields(wire, ("digest", "finish_reason", "logprobs_f32le", "token_ids"), "output")
        output = cls(w["token_ids"], w["logprobs_f32le"], w["finish_reason"])
        if enc.check_digest(w["digest"], "output.digest") != output.digest:
            raise InvalidReceipt(f"output.digest: {w['digest']} is not the digest of the output "
                                 f"({output.digest})")
        return output


@dataclass(frozen=True)
class Receipt:
    """One signed response; `deployment_facts` and `tuple_values` are kept frozen (read-only maps, tuples)."""

    deployment_facts: Mapping[str, Any]
    deployment_hash: str
    tuple_values: Mapping[str, Any]
    tuple_hash: str
    request: RequestRecord
    output: OutputRecord
    node_keyid: str
    time_unix_ns: int

    def __post_init__(self) -> None:
        for name, where in (("deployment_facts", "deployment.facts"), ("tuple_values", "tuple.values")):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not value:
                raise InvalidReceipt(f"{where}: expected a non-empty map, got {enc.describe(value)}")
            object.__setattr__(self, name, enc.freeze(value, where))
        enc.check_digest(self.deployment_hash, "deployment.hash")
        enc.check_digest(self.tuple_hash, "tuple.hash")
        if not isinstance(self.request, RequestRecord) or not isinstance(self.output, OutputRecord):
            raise InvalidReceipt("request and output: expected a RequestRecord and an OutputRecord")
        if len(self.output.token_ids) > self.request.sampling.max_tokens:
            raise InvalidReceipt(f"output.token_ids: {len(self.output.token_ids)} tokens exceed "
                                 f"request.sampling.max_tokens ({self.request.sampling.max_tokens})")
        enc.check_digest(self.node_keyid, "node_keyid")
        enc.check_uint(self.time_unix_ns, "time_unix_ns")

    def to_bytes(self) -> bytes:
        """The canonical payload bytes (what the envelope signs)."""
        return enc.pack({
            "deployment": {"facts": self.deployment_facts, "hash": self.deployment_hash},
            "node_keyid": self.node_keyid, "output": self.output._to_wire(),
            "request": self.request._to_wire(), "time_unix_ns": self.time_unix_ns,
            "tuple": {"hash": self.tuple_hash, "values": self.tuple_values},
            "version": SCHEMA_VERSION,
        })

    @classmethod
    def from_bytes(cls, data: bytes) -> Receipt:
        """Decode payload bytes; every problem (size, malformation, schema, non-canonical): `InvalidReceipt`.

        This checks no signature: a verifier calls `verify_envelope`, which checks it first.
        """
        w = enc.fields(enc.unpack(data, _LIMITS, what="receipt payload"), _FIELDS, "receipt")
        if enc.check_uint(w["version"], "receipt.version") != SCHEMA_VERSION:
            raise InvalidReceipt(f"receipt: schema version {w['version']} is not supported (this release "
                                 f"reads version {SCHEMA_VERSION})", remedy="use the release the node ran")
        deployment = enc.fields(w["deployment"], ("facts", "hash"), "deployment")
        tuple_ = enc.fields(w["tuple"], ("hash", "values"), "tuple")
        receipt = cls(deployment["facts"], deployment["hash"], tuple_["values"], tuple_["hash"],
                      RequestRecord._from_wire(w["request"]), OutputRecord._from_wire(w["output"]),
                      w["node_keyid"], w["time_unix_ns"])
        if receipt.to_bytes() != bytes(data):
            raise InvalidReceipt("receipt payload: not canonical msgpack (re-encoding it gives other bytes: "
                                 "key order, integer or length widths, or duplicate keys differ)")
        return receipt

    @cached_property
    def digest(self) -> str:
        """SHA-256 hex of the payload bytes: the receipt's name in a run manifest."""
        return enc.sha256_hex(self.to_bytes())

    def to_json(self, indent: int | None = 2) -> str:
        """A JSON view for people (not signed, not parsed back): bits as hex beside their decoded values."""
        s, out = self.request.sampling, self.output
        view = {
            "format": f"detent-audit receipt v{SCHEMA_VERSION}, JSON view (the signed form is msgpack)",
            "digest_sha256": self.digest, "node_keyid": self.node_keyid,
            "time": {"unix_ns": self.time_unix_ns, "utc_rfc3339": enc.rfc3339_utc(self.time_unix_ns)},
            "deployment": {"hash_sha256": self.deployment_hash, "facts": enc.thaw(self.deployment_facts)},
            "tuple": {"hash_sha256": self.tuple_hash, "values": enc.thaw(self.tuple_values)},
            "request": {"id": self.request.request_id, "seed": self.request.seed,
                        "prompt_token_ids": list(self.request.prompt_token_ids),
                        "sampling": {"temperature": enc.f64_view(s.temperature),
                                     "top_p": enc.f64_view(s.top_p), "top_k": s.top_k,
                                     "max_tokens": s.max_tokens,
                                     "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos,
                                     "logprobs": s.logprobs}},
            "output": {"token_ids": list(out.token_ids), "finish_reason": out.finish_reason,
                       "digest_sha256": out.digest,
                       "logprobs": {"f32le_hex": out.logprobs_f32le.hex(),
                                    "values": [enc.json_float(v) for v in out.logprobs]}},
        }
        return json.dumps(view, indent=indent, default=lambda b: {"bin_hex": b.hex()})  # bytes in facts


class VerifiedReceipt(NamedTuple):
    """A receipt whose signature verified under the trusted key `keyid`."""

    receipt: Receipt
    keyid: str


def sign_receipt(receipt: Receipt, key: Ed25519PrivateKey) -> bytes:
    """The envelope file bytes of `receipt` signed by `key`, the key `receipt.node_keyid` must name."""
    envelope = sign_envelope(RECEIPT_PAYLOAD_TYPE, receipt.to_bytes(), key, named_keyid=receipt.node_keyid)
    return envelope.to_bytes()


def verify_envelope(data: bytes, trusted_keys: Mapping[str, Ed25519PublicKey]) -> VerifiedReceipt:
    """Verify a receipt file's bytes and decode it: the signature first, the payload after.

    Raises `InvalidReceipt` (malformed), `UntrustedKey` (signer not trusted), `BadSignature`.
    """
    # (0)-(2): bounded envelope decode, signature by a trusted key, payload type (dsse.open_envelope)
    payload, signer = open_envelope(data, trusted_keys, RECEIPT_PAYLOAD_TYPE)
    # (3): the payload: bounded decode, schema, canonical re-encoding
    receipt = Receipt.from_bytes(payload)
    # (4): the payload names its signer
    if receipt.node_keyid != signer:
        raise BadSignature(f"the receipt names node key {receipt.node_keyid}, but key {signer} signed it")
    return VerifiedReceipt(receipt, signer)
