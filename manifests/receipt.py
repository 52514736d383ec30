"""Receipt v2: what a serving node signs for every response, and how a verifier reads it back.

A `Receipt` that exists is well formed: every constructor validates types, ranges and sizes and raises
`InvalidReceipt`; `Receipt.from_bytes` turns every decode problem into `InvalidReceipt` too. The payload is
canonical msgpack (encoding.py), one map, schema version 2 (`version`):

    deployment:   {facts: map, hash: hex}    the deployment's canonical facts and their hash, as its producer
    tuple:        {hash: hex, values: map}   (Deployment.facts_hash, the tuner) computes them; only their
                                             form is checked here, the verifier recomputes them (step 3)
    request:      {client: map, id: str, prompt_token_ids_u32le: bin(4m), sampling: map, seed: u64}
    client:       {api: str, body_json: bin, body_sha256: hex}
    sampling:     {ignore_eos: bool, logprobs: uint|nil, max_tokens: uint, [stop: [str]], stop_token_ids:
    [u32],
                   temperature_f64_bits: u64, top_k: uint, top_p_f64_bits: u64}
    output:       {digest: hex, finish_reason: "length"|"stop", logprobs_f32le: bin(4n), text: str,
                   token_ids_u32le: bin(4n), top_logprobs_f32le: bin(4nk), top_token_ids_u32le: bin(4nk)}
    run:          {id: str, seq: u64}        the node's run and this receipt's place in it (0, 1, ...)
    [scoring]:    {logprobs_f32le: bin(4(m-1)), top_ids: [u32]*(m-1)k, top_logprobs_f32le: bin(4(m-1)k),
                   top_n: uint k}  (an echo request's prompt logprobs: m prompt tokens, the first unscored)
    node_keyid:   hex (SHA-256 of the signer's raw public key; must be the envelope's signer)
    time_unix_ns: u64 (nanoseconds since the Unix epoch, UTC)
    version:      2

What the receipt binds, and why:
- `request.client` is the request **as the client sent it**: `api` names its schema and endpoint
  (`openai/v1/completions`, `openai/v1/chat/completions`, `detent/v1/offline-jsonl`), `body_json` is the
  body's canonical JSON (`body_json`: keys sorted, no whitespace, UTF-8, no NaN; what a client computes
  over the body it sent) and `body_sha256` its SHA-256. A verifier parses the body again with the node's own
  parser for that `api` and requires the prompt ids and sampling below to be what it gives: a node cannot
  answer another prompt, other sampling, a lower `max_tokens` or extra stop ids under the client's id. The
  kinds admit disjoint bodies (an offline line is bound with its id, which the HTTP endpoints refuse), so the
  `api` is the endpoint the client called: a client compares it (`verify-response`).
- `request.prompt_token_ids_u32le` and `sampling`/`seed` are the request as the engine ran it (token ids,
  never text: a verifier re-runs ids, not a template).
- `output.text` is the text returned to the client and `output.top_*` the top-k alternatives returned at
  each output position (k = the request's `logprobs`, or 0): token ids as u32le, logprobs as f32le, k per
  position, position-major. A verifier recomputes both; a client compares them with what it received.
- `run` ties the receipt to the run manifests that must cover it (run_manifest.py).
- `sampling.stop` (present only when the request had stop strings): the output ends at the first token whose
  detokenized text contains one (vLLM's rule, detent_audit.runtime.stop_strings), which a verifier recomputes
  with the deployment's tokenizer; `output.text` is cut before it.
- `scoring` (present only for an echo request): every prompt position's logprob bits and the top-k
  alternatives it returned (ids and fp32 bits, most likely first; k = the request's `logprobs`). max_tokens
  may be 0 only in a receipt that has it (the prompt scored, nothing drawn).

Floats travel as IEEE-754 bits: temperature and top_p as the uint64 bits of their binary64 value (the exact
Python float the request carried: no rounding; -0.0 and NaN payloads kept); logprobs as little-endian
binary32, 4 bytes each, exactly as the engine's fp32 tensor held them. Token ids travel as little-endian u32
(one bin, not an array of ints: a payload decodes into few objects, so the decoder's object budget can be
small). Hashes are lowercase hex.

output.digest = SHA-256(b"detent-audit/output/v2\\0" || u64le(n) || token_ids_u32le || logprobs_f32le
                        || u64le(k) || top_token_ids_u32le || top_logprobs_f32le || u64le(len) || text_utf8)
A receipt's own digest (what run manifests list, what a response carries) is SHA-256 of its payload bytes
(`Receipt.digest`).

A verifier checks a receipt in ten steps, numbered the same in `detent_audit.verifier.steps` and in
docs/design.md section 7 (steps 1-3 are `verify_envelope` here):
(1) read: a bounded read, the envelope decoded; (2) signature: by a trusted key, before the payload is
parsed, then the payload type; (3) payload: schema, canonical re-encoding, `node_keyid` the signer's, the
deployment and tuple hashes recomputed; (4) claims: the file is named after `request.id`, `time_unix_ns` is
plausible, the deployment published; (5) run manifests and (6) coverage: `run` places the receipt in them;
(7) deployment: the engine rebuilt from `deployment.facts` and `tuple`; (8) output: ids in the vocabulary,
`finish_reason` by the scheduler's rule, `sampling.stop` recomputed; (9) request: `request.client` parsed
again gives `prompt_token_ids`, `sampling` and `seed`, `output.text` is the tokens' text; (10) bits:
`output` (and `scoring`) recomputed, the fp32 bits compared.

Adding a field: a later field is optional in `from_bytes` (`dec.fields(..., optional=...)`) and omitted from
`to_bytes` at its default, so receipts that do not use it keep their bytes; a verifier that does not know a
field refuses the receipt (unknown fields are errors), never ignores it. A change of meaning bumps the
version and the payload type.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from detent_audit.manifests import decoding as dec
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import (
    MAX_PAYLOAD_BYTES,
    RECEIPT_PAYLOAD_TYPE,
    OpenedEnvelope,
    open_envelope,
    sign_envelope,
)
from detent_audit.manifests.encoding import JsonValue
from detent_audit.manifests.errors import BadSignature, InvalidReceipt

SCHEMA_VERSION = 2
MAX_TOKENS = 1 << 22  # prompt or output tokens per request
MAX_REQUEST_ID_LEN = 256
MAX_STOP_TOKENS = 1024
MAX_LOGPROBS = 1024  # top-n alternatives a request may ask for (the engine allows fewer)
MAX_CLIENT_BODY = 16 << 20  # bytes of a client request's canonical JSON a receipt carries
MAX_TEXT_BYTES = 16 << 20
MAX_API_LEN = 64
MAX_RUN_ID_LEN = 128
FINISH_REASONS = ("length", "stop")
OUTPUT_DIGEST_TAG = b"detent-audit/output/v2\x00"
CLIENT_APIS = ("openai/v1/completions", "openai/v1/chat/completions", "detent/v1/offline-jsonl")
MAX_JSON_CONTAINERS = 1 << 20  # arrays and objects in a client body (bounds the memory of parsing it)
_LIMITS = dec.Limits(max_bytes=MAX_PAYLOAD_BYTES, max_str_len=MAX_TEXT_BYTES, max_bin_len=MAX_CLIENT_BODY,
                     max_array_len=4096, max_map_len=4096, max_objects=1 << 16)
_SAMPLING_FIELDS = ("ignore_eos", "logprobs", "max_tokens", "stop_token_ids", "temperature_f64_bits", "top_k",
                    "top_p_f64_bits")
_FIELDS = ("deployment", "node_keyid", "output", "request", "run", "time_unix_ns", "tuple", "version")
_SCORING_FIELDS = ("logprobs_f32le", "top_ids", "top_logprobs_f32le", "top_n")
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


class EngineSampling(Protocol):
    """An engine's sampling parameters as `SamplingRecord.from_params` reads them (by attribute, so this
    module imports no engine; its stop strings, where it has them, by `getattr`)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> Sequence[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...


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
    stop: tuple[str, ...] = ()

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
        dec.check_uint(self.top_k, "request.sampling.top_k", enc.UINT32_MAX)
        dec.check_uint(self.max_tokens, "request.sampling.max_tokens", MAX_TOKENS)  # 0: scoring only (echo)
        stop = dec.check_token_ids(self.stop_token_ids, "request.sampling.stop_token_ids", MAX_STOP_TOKENS)
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidReceipt(f"request.sampling.ignore_eos: expected a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            dec.check_uint(self.logprobs, "request.sampling.logprobs", MAX_LOGPROBS)
        if not isinstance(self.stop, (tuple, list)) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidReceipt(f"request.sampling.stop: expected at most {MAX_STOP_STRINGS} strings, "
                                 f"got {dec.describe(self.stop)}")
        object.__setattr__(self, "stop", tuple(dec.check_str(s, "request.sampling.stop", MAX_STOP_CHARS)
                                               for s in self.stop))

    @classmethod
    def from_params(cls, params: EngineSampling, max_tokens: int | None = None) -> SamplingRecord:
        """From the engine's `SamplingParams` (read by attribute, so this module never imports the engine);
        `max_tokens` where the request's differs from the engine's (0 for an echo request that draws
        nothing)."""
        return cls(params.temperature, params.top_k, params.top_p,
                   params.max_tokens if max_tokens is None else max_tokens,
                   tuple(params.stop_token_ids), params.ignore_eos, params.logprobs,
                   tuple(getattr(params, "stop", ())))

    def _to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {
            "ignore_eos": self.ignore_eos, "logprobs": self.logprobs, "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids), "top_k": self.top_k,
            "temperature_f64_bits": enc.f64_to_bits(self.temperature),
            "top_p_f64_bits": enc.f64_to_bits(self.top_p)}
        return {**wire, "stop": list(self.stop)} if self.stop else wire

    @classmethod
    def _from_wire(cls, wire: object) -> SamplingRecord:
        w = dec.fields(wire, _SAMPLING_FIELDS, "request.sampling", optional=("stop",))
        if w["stop"] is not None and not w["stop"]:
            raise InvalidReceipt("request.sampling.stop: present but empty (an absent key means no stop "
                                 "strings)")
        bits = {name: dec.check_uint(w[f"{name}_f64_bits"], f"request.sampling.{name}_f64_bits")
                for name in ("temperature", "top_p")}
        temperature, top_p = enc.f64_from_bits(bits["temperature"]), enc.f64_from_bits(bits["top_p"])
        return cls(temperature, w["top_k"], top_p, w["max_tokens"], w["stop_token_ids"], w["ignore_eos"],
                   w["logprobs"], tuple(w["stop"] or ()))


def body_json(body: object) -> bytes:
    """A request body's canonical JSON (`encoding.canonical_json`, UTF-8 rather than ASCII escapes): what a
    client computes `body_sha256` over, for the body it sent. Raises `InvalidReceipt` for a non-JSON value."""
    try:
        return enc.canonical_json(body, ascii=False)
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
        raise InvalidReceipt("request.client.body_json: not a JSON value with a canonical form "
                             f"({exc})") from None


def parse_canonical_json(data: bytes,
                         where: str = "request.client.body_json") -> dict[str, JsonValue]:
    """The JSON object of canonical bytes, in bounded memory: at most `MAX_JSON_CONTAINERS` arrays and objects
    (counted as bracket bytes before parsing), no repeated key, and the bytes must be its canonical form."""
    if data.count(b"[") + data.count(b"{") > MAX_JSON_CONTAINERS:
        raise InvalidReceipt(f"{where}: more than {MAX_JSON_CONTAINERS} arrays and objects")

    def unique(pairs: list[tuple[str, JsonValue]]) -> dict[str, JsonValue]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise ValueError("a key appears twice in one object")
        return out

    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=unique)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise InvalidReceipt(f"{where}: not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise InvalidReceipt(f"{where}: expected a JSON object")
    if body_json(value) != data:
        raise InvalidReceipt(f"{where}: not canonical JSON (re-encoded, it differs)")
    return value


@dataclass(frozen=True)
class ClientRequest:
    """The request as the client sent it: its API and its body's canonical JSON (`body_json`)."""

    api: str
    body_json: bytes

    def __post_init__(self) -> None:
        if self.api not in CLIENT_APIS:
            raise InvalidReceipt(f"request.client.api: expected one of {', '.join(CLIENT_APIS)}, got "
                                 f"{dec.describe(self.api)}")
        if not isinstance(self.body_json, bytes) or not 2 <= len(self.body_json) <= MAX_CLIENT_BODY:
            raise InvalidReceipt(f"request.client.body_json: expected 2 to {MAX_CLIENT_BODY} bytes of JSON, "
                                 f"got {dec.describe(self.body_json)}")

    @classmethod
    def of(cls, api: str, body: object) -> ClientRequest:
        """From a parsed JSON body (a client's, or the node's as it parsed the request)."""
        return cls(api, body_json(body))

    @cached_property
    def body_sha256(self) -> str:
        return enc.sha256_hex(self.body_json)

    def body(self) -> dict[str, JsonValue]:
        """The body as a JSON object (parsed in bounded memory; refused unless canonical)."""
        return parse_canonical_json(self.body_json)

    def _to_wire(self) -> dict[str, object]:
        return {"api": self.api, "body_json": self.body_json, "body_sha256": self.body_sha256}

    @classmethod
    def _from_wire(cls, wire: object) -> ClientRequest:
        w = dec.fields(wire, ("api", "body_json", "body_sha256"), "request.client")
        client = cls(w["api"], w["body_json"])
        if dec.check_digest(w["body_sha256"], "request.client.body_sha256") != client.body_sha256:
            raise InvalidReceipt("request.client.body_sha256: not the SHA-256 of body_json")
        return client


def _ids_from_wire(value: object, where: str, max_len: int, min_len: int = 0) -> tuple[int, ...]:
    if not isinstance(value, bytes) or len(value) % 4 or not min_len <= len(value) // 4 <= max_len:
        raise InvalidReceipt(f"{where}: expected {min_len} to {max_len} token ids as u32le bytes, got "
                             f"{dec.describe(value)}")
    return enc.u32le_unpack(value)


@dataclass(frozen=True)
class RequestRecord:
    """The request: as the client sent it (`client`), and as the engine ran it (token ids and sampling)."""

    request_id: str
    client: ClientRequest
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingRecord
    seed: int  # unsigned 64-bit sampling seed, recorded also when greedy

    def __post_init__(self) -> None:
        dec.check_str(self.request_id, "request.id", MAX_REQUEST_ID_LEN)
        if not isinstance(self.client, ClientRequest):
            raise InvalidReceipt(f"request.client: expected a ClientRequest, got {dec.describe(self.client)}")
        prompt = dec.check_token_ids(self.prompt_token_ids, "request.prompt_token_ids", MAX_TOKENS, min_len=1)
        object.__setattr__(self, "prompt_token_ids", prompt)
        if not isinstance(self.sampling, SamplingRecord):
            raise InvalidReceipt(f"request.sampling: expected a SamplingRecord, "
                                 f"got {dec.describe(self.sampling)}")
        dec.check_uint(self.seed, "request.seed")

    def _to_wire(self) -> dict[str, object]:
        return {"client": self.client._to_wire(), "id": self.request_id,
                "prompt_token_ids_u32le": enc.u32le_pack(self.prompt_token_ids),
                "sampling": self.sampling._to_wire(), "seed": self.seed}

    @classmethod
    def _from_wire(cls, wire: object) -> RequestRecord:
        w = dec.fields(wire, ("client", "id", "prompt_token_ids_u32le", "sampling", "seed"), "request")
        return cls(w["id"], ClientRequest._from_wire(w["client"]),
                   _ids_from_wire(w["prompt_token_ids_u32le"], "request.prompt_token_ids_u32le", MAX_TOKENS,
                                  1),
                   SamplingRecord._from_wire(w["sampling"]), w["seed"])


@dataclass(frozen=True)
class RunRecord:
    """Which run of the node signed the receipt, and its sequence number in that run (0, 1, ...)."""

    run_id: str
    seq: int

    def __post_init__(self) -> None:
        dec.check_str(self.run_id, "run.id", MAX_RUN_ID_LEN)
        dec.check_uint(self.seq, "run.seq")

    def _to_wire(self) -> dict[str, object]:
        return {"id": self.run_id, "seq": self.seq}

    @classmethod
    def _from_wire(cls, wire: object) -> RunRecord:
        w = dec.fields(wire, ("id", "seq"), "run")
        return cls(w["id"], w["seq"])


@dataclass(frozen=True)
class OutputRecord:
    """The response: output token ids, each token's fp32 logprob as little-endian bytes, why it stopped, the
    text returned, and the top-k alternatives returned at each position (k per position, position-major)."""

    token_ids: tuple[int, ...]
    logprobs_f32le: bytes  # 4 bytes per output token
    finish_reason: str
    text: str = ""
    top_token_ids: tuple[int, ...] = ()
    top_logprobs_f32le: bytes = b""

    def __post_init__(self) -> None:
        tokens = dec.check_token_ids(self.token_ids, "output.token_ids", MAX_TOKENS)
        object.__setattr__(self, "token_ids", tokens)
        if not isinstance(self.logprobs_f32le, bytes) or len(self.logprobs_f32le) != 4 * len(self.token_ids):
            raise InvalidReceipt(f"output.logprobs_f32le: expected {4 * len(self.token_ids)} bytes (4 per "
                                 f"output token), got {dec.describe(self.logprobs_f32le)}")
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidReceipt(f"output.finish_reason: expected one of {', '.join(FINISH_REASONS)}, "
                                 f"got {self.finish_reason!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_TEXT_BYTES:
            raise InvalidReceipt(f"output.text: expected a string, got {dec.describe(self.text)}")
        dec.check_str(self.text, "output.text", MAX_TEXT_BYTES, min_len=0)
        top = dec.check_token_ids(self.top_token_ids, "output.top_token_ids", MAX_LOGPROBS * MAX_TOKENS)
        object.__setattr__(self, "top_token_ids", top)
        n = len(self.token_ids)
        if (n == 0 and top) or (n and len(top) % n) or len(top) > n * MAX_LOGPROBS:
            raise InvalidReceipt(f"output.top_token_ids: {len(top)} ids are not k per output token for the "
                                 f"{n} tokens (k <= {MAX_LOGPROBS})")
        if not isinstance(self.top_logprobs_f32le, bytes) or len(self.top_logprobs_f32le) != 4 * len(top):
            raise InvalidReceipt(f"output.top_logprobs_f32le: expected {4 * len(top)} bytes (4 per top "
                                 f"token id), got {dec.describe(self.top_logprobs_f32le)}")

    @classmethod
    def from_floats(cls, token_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str,
                    text: str = "", top_logprobs: Sequence[Sequence[tuple[int, float]]] = ()) -> OutputRecord:
        """From Python floats, each rounded to fp32 (from a tensor: `t.numpy().astype("<f4").tobytes()`);
        `top_logprobs`: per output token, its (token id, logprob) alternatives, the same count at each."""
        tops = [list(t) for t in top_logprobs] if any(top_logprobs) else []
        if tops and (len(tops) != len(token_ids) or len({len(t) for t in tops}) != 1):
            raise InvalidReceipt("output.top_logprobs: expected the same number of alternatives at every "
                                 "output token")
        return cls(tuple(token_ids), enc.f32le_pack(logprobs), finish_reason, text,
                   tuple(i for t in tops for i, _ in t), enc.f32le_pack(v for t in tops for _, v in t))

    @property
    def logprobs(self) -> tuple[float, ...]:
        """The logprobs as floats (exact: every binary32 value is a binary64 value)."""
        return enc.f32le_unpack(self.logprobs_f32le)

    @property
    def top_k(self) -> int:
        """Alternatives per output position."""
        return len(self.top_token_ids) // len(self.token_ids) if self.token_ids else 0

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]]:
        """Per output token, its (token id, logprob) alternatives ([] per token when none were returned)."""
        k, values = self.top_k, enc.f32le_unpack(self.top_logprobs_f32le)
        if not k:
            return [[] for _ in self.token_ids]
        return [list(zip(self.top_token_ids[i * k:(i + 1) * k], values[i * k:(i + 1) * k]))
                for i in range(len(self.token_ids))]

    @cached_property
    def digest(self) -> str:
        """SHA-256 over a tag, the tokens, logprobs, alternatives and text (module docstring)."""
        text = self.text.encode("utf-8")
        parts = [OUTPUT_DIGEST_TAG, struct.pack("<Q", len(self.token_ids)), enc.u32le_pack(self.token_ids),
                 self.logprobs_f32le, struct.pack("<Q", self.top_k), enc.u32le_pack(self.top_token_ids),
                 self.top_logprobs_f32le, struct.pack("<Q", len(text)), text]
        return enc.sha256_hex(b"".join(parts))

    def _to_wire(self) -> dict[str, object]:
        return {"digest": self.digest, "finish_reason": self.finish_reason,
                "logprobs_f32le": self.logprobs_f32le, "text": self.text,
                "token_ids_u32le": enc.u32le_pack(self.token_ids),
                "top_logprobs_f32le": self.top_logprobs_f32le,
                "top_token_ids_u32le": enc.u32le_pack(self.top_token_ids)}

    @classmethod
    def _from_wire(cls, wire: object) -> OutputRecord:
        w = dec.fields(wire, ("digest", "finish_reason", "logprobs_f32le", "text", "token_ids_u32le",
                              "top_logprobs_f32le", "top_token_ids_u32le"), "output")
        output = cls(_ids_from_wire(w["token_ids_u32le"], "output.token_ids_u32le", MAX_TOKENS),
                     w["logprobs_f32le"], w["finish_reason"], w["text"],
                     _ids_from_wire(w["top_token_ids_u32le"], "output.top_token_ids_u32le",
                                    MAX_LOGPROBS * MAX_TOKENS),
                     w["top_logprobs_f32le"])
        if dec.check_digest(w["digest"], "output.digest") != output.digest:
            raise InvalidReceipt(f"output.digest: {w['digest']} is not the digest of the output "
                                 f"({output.digest})")
        return output


@dataclass(frozen=True)
class ScoringRecord:
    """An echo request's prompt logprobs: for each prompt token after the first, its fp32 logprob and the
    top-n alternatives the response returned (ids, fp32 logprobs; most likely first)."""

    logprobs_f32le: bytes             # 4 bytes per scored prompt position
    top_n: int = 0
    top_ids: tuple[int, ...] = ()     # top_n per position
    top_logprobs_f32le: bytes = b""   # 4 bytes per entry of top_ids

    def __post_init__(self) -> None:
        if not isinstance(self.logprobs_f32le, bytes) or len(self.logprobs_f32le) % 4:
            raise InvalidReceipt(f"scoring.logprobs_f32le: expected 4 bytes per prompt position, "
                                 f"got {dec.describe(self.logprobs_f32le)}")
        dec.check_uint(self.top_n, "scoring.top_n", MAX_LOGPROBS)
        ids = dec.check_token_ids(self.top_ids, "scoring.top_ids", MAX_TOKENS * 8)
        object.__setattr__(self, "top_ids", ids)
        if len(ids) != self.num_positions * self.top_n:
            raise InvalidReceipt(f"scoring.top_ids: expected {self.top_n} per position "
                                 f"({self.num_positions * self.top_n}), got {len(ids)}")
        if not isinstance(self.top_logprobs_f32le, bytes) or len(self.top_logprobs_f32le) != 4 * len(ids):
            raise InvalidReceipt(f"scoring.top_logprobs_f32le: expected {4 * len(ids)} bytes (4 per top id), "
                                 f"got {dec.describe(self.top_logprobs_f32le)}")

    @property
    def num_positions(self) -> int:
        return len(self.logprobs_f32le) // 4

    @classmethod
    def from_floats(cls, logprobs: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]], top_n: int
                    ) -> ScoringRecord:
        """From Python floats (rounded to fp32) and, per position, the top-n (id, logprob) pairs."""
        if any(len(t) != top_n for t in tops) or (top_n and len(tops) != len(logprobs)):
            raise InvalidReceipt(f"scoring: expected {top_n} alternatives at each of {len(logprobs)} "
                                 "positions")
        pairs = [pair for t in tops for pair in t]
        return cls(enc.f32le_pack(logprobs), top_n, tuple(i for i, _ in pairs),
                   enc.f32le_pack([v for _, v in pairs]))

    @property
    def logprobs(self) -> tuple[float, ...]:
        return enc.f32le_unpack(self.logprobs_f32le)

    @property
    def tops(self) -> list[list[tuple[int, float]]]:
        """Per position, its top-n (id, fp32 logprob) pairs."""
        values, k = enc.f32le_unpack(self.top_logprobs_f32le), self.top_n
        pairs = list(zip(self.top_ids, values))
        return [pairs[i * k:(i + 1) * k] for i in range(self.num_positions)] if k else []

    def _to_wire(self) -> dict[str, object]:
        return {"logprobs_f32le": self.logprobs_f32le, "top_ids": list(self.top_ids),
                "top_logprobs_f32le": self.top_logprobs_f32le, "top_n": self.top_n}

    @classmethod
    def _from_wire(cls, wire: object) -> ScoringRecord:
        w = dec.fields(wire, _SCORING_FIELDS, "scoring")
        return cls(w["logprobs_f32le"], w["top_n"], w["top_ids"], w["top_logprobs_f32le"])


@dataclass(frozen=True)
class Receipt:
    """One signed response; `deployment_facts` and `tuple_values` are kept frozen (read-only maps, tuples)."""

    deployment_facts: Mapping[str, Any]
    deployment_hash: str
    tuple_values: Mapping[str, Mapping[str, object]]  # family -> axis -> value (`encoding.check_tuple`)
    tuple_hash: str
    request: RequestRecord
    output: OutputRecord
    run: RunRecord
    node_keyid: str
    time_unix_ns: int
    scoring: ScoringRecord | None = None  # an echo request's prompt logprobs

    def __post_init__(self) -> None:
        for name, where in (("deployment_facts", "deployment.facts"), ("tuple_values", "tuple.values")):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not value:
                raise InvalidReceipt(f"{where}: expected a non-empty map, got {dec.describe(value)}")
            object.__setattr__(self, name, enc.freeze(value, where, allow_bytes=False))
        dec.check_digest(self.deployment_hash, "deployment.hash")
        dec.check_digest(self.tuple_hash, "tuple.hash")
        if not isinstance(self.request, RequestRecord) or not isinstance(self.output, OutputRecord):
            raise InvalidReceipt("request and output: expected a RequestRecord and an OutputRecord")
        if not isinstance(self.run, RunRecord):
            raise InvalidReceipt(f"run: expected a RunRecord, got {dec.describe(self.run)}")
        if len(self.output.token_ids) > self.request.sampling.max_tokens:
            raise InvalidReceipt(f"output.token_ids: {len(self.output.token_ids)} tokens exceed "
                                 f"request.sampling.max_tokens ({self.request.sampling.max_tokens})")
        dec.check_digest(self.node_keyid, "node_keyid")
        dec.check_uint(self.time_unix_ns, "time_unix_ns")
        if self.scoring is not None:
            if not isinstance(self.scoring, ScoringRecord):
                raise InvalidReceipt(f"scoring: expected a ScoringRecord, got {dec.describe(self.scoring)}")
            if self.scoring.num_positions != len(self.request.prompt_token_ids) - 1:
                raise InvalidReceipt(f"scoring: {self.scoring.num_positions} prompt logprobs for a prompt of "
                                     f"{len(self.request.prompt_token_ids)} tokens (expected one per token "
                                     f"after the first)")
            if self.scoring.top_n != (self.request.sampling.logprobs or 0):
                raise InvalidReceipt(f"scoring.top_n: {self.scoring.top_n} alternatives per prompt position, "
                                     f"but the request asked for {self.request.sampling.logprobs or 0}")
        elif self.request.sampling.max_tokens == 0:
            raise InvalidReceipt("request.sampling.max_tokens: 0 only in a receipt that scores its prompt "
                                 "(scoring)")

    def to_bytes(self) -> bytes:
        """The canonical payload bytes (what the envelope signs)."""
        payload = {
            "deployment": {"facts": self.deployment_facts, "hash": self.deployment_hash},
            "node_keyid": self.node_keyid, "output": self.output._to_wire(),
            "request": self.request._to_wire(), "run": self.run._to_wire(), "time_unix_ns": self.time_unix_ns,
            "tuple": {"hash": self.tuple_hash, "values": self.tuple_values},
            "version": SCHEMA_VERSION,
        }
        if self.scoring is not None:
            payload["scoring"] = self.scoring._to_wire()
        return enc.pack(payload)

    @classmethod
    def from_bytes(cls, data: bytes) -> Receipt:
        """Decode payload bytes; every problem (size, malformation, schema, non-canonical): `InvalidReceipt`.

        This checks no signature: a verifier calls `verify_envelope`, which checks it first.
        """
        w = dec.fields(dec.unpack(data, _LIMITS, what="receipt payload"), _FIELDS, "receipt",
                       optional=("scoring",))
        if dec.check_uint(w["version"], "receipt.version") != SCHEMA_VERSION:
            raise InvalidReceipt(f"receipt: schema version {w['version']} is not supported (this release "
                                 f"reads version {SCHEMA_VERSION})", remedy="use the release the node ran")
        deployment = dec.fields(w["deployment"], ("facts", "hash"), "deployment")
        tuple_ = dec.fields(w["tuple"], ("hash", "values"), "tuple")
        receipt = cls(deployment["facts"], deployment["hash"], tuple_["values"], tuple_["hash"],
                      RequestRecord._from_wire(w["request"]), OutputRecord._from_wire(w["output"]),
                      RunRecord._from_wire(w["run"]), w["node_keyid"], w["time_unix_ns"],
                      None if w["scoring"] is None else ScoringRecord._from_wire(w["scoring"]))
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
            "run": {"id": self.run.run_id, "seq": self.run.seq},
            "request": {"id": self.request.request_id, "seed": self.request.seed,
                        "client": {"api": self.request.client.api,
                                   "body_sha256": self.request.client.body_sha256,
                                   "body_json": self.request.client.body_json.decode("utf-8", "replace")},
                        "prompt_token_ids": list(self.request.prompt_token_ids),
                        "sampling": {"temperature": enc.f64_view(s.temperature),
                                     "top_p": enc.f64_view(s.top_p), "top_k": s.top_k,
                                     "max_tokens": s.max_tokens,
                                     "stop_token_ids": list(s.stop_token_ids), "ignore_eos": s.ignore_eos,
                                     "logprobs": s.logprobs, "stop": list(s.stop)}},
            "output": {"token_ids": list(out.token_ids), "finish_reason": out.finish_reason,
                       "digest_sha256": out.digest, "text": out.text,
                       "top_logprobs": [[[i, enc.json_float(v)] for i, v in top] for top in out.top_logprobs],
                       "logprobs": {"f32le_hex": out.logprobs_f32le.hex(),
                                    "values": [enc.json_float(v) for v in out.logprobs]}},
        }
        if self.scoring is not None:
            sc = self.scoring
            view["scoring"] = {"prompt_logprobs": {"f32le_hex": sc.logprobs_f32le.hex(),
                                                   "values": [enc.json_float(v) for v in sc.logprobs]},
                               "top_n": sc.top_n,
                               "top_logprobs": [[[i, enc.json_float(v)] for i, v in t] for t in sc.tops]}
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
    """Verify a receipt file's bytes and decode it: steps (1)-(3), the signature first, the payload after.

    Raises `InvalidReceipt` (malformed), `UntrustedKey` (signer not trusted), `BadSignature`.
    """
    # (1)-(2): bounded envelope decode, signature by a trusted key, payload type (dsse.open_envelope)
    return open_payload(open_envelope(data, trusted_keys, RECEIPT_PAYLOAD_TYPE))


def open_payload(opened: OpenedEnvelope) -> VerifiedReceipt:
    """Step (3): the signed payload decoded (bounded, schema, canonical re-encoding); it names its signer."""
    receipt = Receipt.from_bytes(opened.payload)
    if receipt.node_keyid != opened.keyid:
        raise BadSignature(f"the receipt names node key {receipt.node_keyid}, but key {opened.keyid} signed "
                           "it")
    return VerifiedReceipt(receipt, opened.keyid)
