"""Receipts and run manifests exported as in-toto Statements v1, alone, in a DSSE envelope, or in a sigstore
bundle; and such an export read back to the node's own envelope.

The node signs PAE(payloadType, payload) of its own envelope (dsse.py); no export can re-sign with the node's
key, so an export carries that envelope whole and unchanged in its Statement (`predicate.envelope`: the DSSE
JSON form, payload and signature base64) and is lossless: `envelope_from_json` gives back the node's file.
The rest of the Statement is a function of that envelope (`statement`), so a reader rebuilds it from the
signed payload and requires equality: no claim of an export is taken unsigned.

A receipt's Statement (predicate type `RECEIPT_PREDICATE_TYPE`), named as SLSA provenance v1 names the same
things:

    subject:   [{name: "response/<request id>", digest: {sha256: output.digest}}]   (tokens, logprobs, text)
    predicate: {buildDefinition: {buildType, externalParameters: {request: {api, body, body_sha256},
                                  request_id, seed}, internalParameters: {deployment, tuple, prompt_tokens},
                                  resolvedDependencies: [weights, config, tokenizer, engine sources]},
                runDetails: {builder: {id: node key}, metadata: {invocationId: "<run id>/<seq>", finishedOn},
                             byproducts: [{name: "logprobs", digest: {sha256: of output.logprobs_f32le}}]},
                envelope: the node's DSSE envelope}

A run manifest's Statement (`RUN_MANIFEST_PREDICATE_TYPE`) has the subject `run/<run id>/<seq_first>` with the
SHA-256 of its payload and the predicate {runId, kind, seqFirst, seqLast, merkleRoot, receiptCount, envelope}.
An envelope whose payload does not decode is carried as it is (`ENVELOPE_PREDICATE_TYPE`, the subject its
payload's SHA-256), so that its export is refused where the node's file is, for the same reason.

Outer forms: the Statement alone (JSON); a DSSE JSON envelope of payload type `application/vnd.in-toto+json`
signed by a key the exporter holds; a sigstore bundle v0.3 with that envelope, `publicKey.hint` = its keyid
and no transparency-log entry (`tlogEntries: []`). The exporter's signature is the toolchain's; a reader
checks it when its key is trusted, and rests on the node's signature inside either way.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from detent_audit.manifests import decoding as dec
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import (
    MAX_ENVELOPE_BYTES,
    RECEIPT_PAYLOAD_TYPE,
    RUN_MANIFEST_PAYLOAD_TYPE,
    Envelope,
    sign_envelope,
)
from detent_audit.manifests.encoding import JsonValue
from detent_audit.manifests.errors import BadSignature, InvalidReceipt
from detent_audit.manifests.keys import keyid as keyid_of
from detent_audit.manifests.receipt import Receipt
from detent_audit.manifests.run_manifest import RunManifest

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
INTOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
RECEIPT_PREDICATE_TYPE = "https://detent-audit.dev/inference-receipt/v1"
RUN_MANIFEST_PREDICATE_TYPE = "https://detent-audit.dev/run-manifest/v1"
ENVELOPE_PREDICATE_TYPE = "https://detent-audit.dev/signed-envelope/v1"
BUILDER_PREFIX = "https://detent-audit.dev/node/"
FORMATS = ("intoto", "sigstore-bundle")
SUFFIXES = {"intoto": ".intoto.json", "sigstore-bundle": ".sigstore.json"}
MAX_EXPORT_BYTES = 2 * MAX_ENVELOPE_BYTES  # base64 of the node's envelope inside base64 of the Statement


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object, where: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidReceipt(f"{where}: expected base64 text, got {dec.describe(text)}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise InvalidReceipt(f"{where}: not base64") from None


def envelope_json(envelope: Envelope) -> dict[str, JsonValue]:
    """The DSSE JSON form of an envelope (DSSE envelope.md): payload and signature base64."""
    return {"payload": _b64(envelope.payload), "payloadType": envelope.payload_type,
            "signatures": [{"keyid": envelope.keyid, "sig": _b64(envelope.signature)}]}


def envelope_from_json(wire: object, where: str) -> Envelope:
    """An `Envelope` from its DSSE JSON form (exactly one signature, as dsse.py requires)."""
    w = dec.fields(wire, ("payload", "payloadType", "signatures"), where)
    if not isinstance(w["signatures"], list) or len(w["signatures"]) != 1:
        raise InvalidReceipt(f"{where}.signatures: expected exactly one signature")
    sig = dec.fields(w["signatures"][0], ("keyid", "sig"), f"{where}.signatures[0]")
    return Envelope(w["payloadType"], _unb64(w["payload"], f"{where}.payload"), sig["keyid"],
                    _unb64(sig["sig"], f"{where}.signatures[0].sig"))


def _digest(name: str, value: object) -> JsonValue:
    """A resource descriptor of a 64-hex SHA-256 fact (`tensors-sha256:` weights named so); else None."""
    if not isinstance(value, str):
        return None
    algorithm, _, hexdigest = value.rpartition(":")
    if len(hexdigest) != 64 or not dec.HEX_DIGITS.issuperset(hexdigest):
        return None
    return {"name": name, "digest": {(algorithm or "sha256"): hexdigest}}


def _resolved_dependencies(facts: Mapping[str, object]) -> list[JsonValue]:
    """The checkpoint's files and the engine's sources, each a digest the facts state."""
    out: list[JsonValue] = []
    checkpoint = facts.get("checkpoint", {})
    for part in ("weights", "config", "tokenizer"):
        value = checkpoint.get(part) if isinstance(checkpoint, Mapping) else None
        if (rd := _digest(part, value)) is not None:
            out.append(rd)
    engine = facts.get("engine", {})
    sources = engine.get("sources", {}) if isinstance(engine, Mapping) else {}
    if not isinstance(sources, Mapping):
        return out
    for name in sorted(sources):
        if (rd := _digest(f"engine/{name}", sources[name])) is not None:
            out.append(rd)
    return out


def receipt_statement(envelope: Envelope, receipt: Receipt) -> dict[str, JsonValue]:
    """The in-toto Statement of a receipt and the node's envelope that signs it (module docstring)."""
    r, out = receipt, receipt.output
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"response/{r.request.request_id}", "digest": {"sha256": out.digest}}],
        "predicateType": RECEIPT_PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": RECEIPT_PREDICATE_TYPE,
                "externalParameters": {
                    "request": {"api": r.request.client.api, "body": r.request.client.body(),
                                "body_sha256": r.request.client.body_sha256},
                    "request_id": r.request.request_id, "seed": r.request.seed},
                "internalParameters": {"deployment": {"sha256": r.deployment_hash},
                                       "tuple": {"sha256": r.tuple_hash},
                                       "prompt_tokens": len(r.request.prompt_token_ids)},
                "resolvedDependencies": _resolved_dependencies(r.deployment_facts),
            },
            "runDetails": {
                "builder": {"id": f"{BUILDER_PREFIX}{r.node_keyid}"},
                "metadata": {"invocationId": f"{r.run.run_id}/{r.run.seq}",
                             "finishedOn": enc.rfc3339_utc(r.time_unix_ns)},
                "byproducts": [{"name": "logprobs", "digest": {"sha256": enc.sha256_hex(out.logprobs_f32le)},
                                "mediaType": "application/octet-stream; float32 little-endian"}],
            },
            "envelope": envelope_json(envelope),
        },
    }


def manifest_statement(envelope: Envelope, manifest: RunManifest) -> dict[str, JsonValue]:
    """The in-toto Statement of a run manifest and the node's envelope that signs it."""
    m = manifest
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"run/{m.run_id}/{m.seq_first}",
                     "digest": {"sha256": enc.sha256_hex(envelope.payload)}}],
        "predicateType": RUN_MANIFEST_PREDICATE_TYPE,
        "predicate": {"runId": m.run_id, "kind": m.kind, "seqFirst": m.seq_first, "seqLast": m.seq_last,
                      "merkleRoot": m.merkle_root, "receiptCount": m.receipt_count,
                      "builder": {"id": f"{BUILDER_PREFIX}{m.node_keyid}"},
                      "envelope": envelope_json(envelope)},
    }


def envelope_statement(envelope: Envelope) -> dict[str, JsonValue]:
    """The Statement of a node's envelope whose payload does not decode (or is of another type): its subject
    the payload's SHA-256, its predicate the envelope alone, so that a reader reaches the verdict it reaches
    on the node's file."""
    return {"_type": STATEMENT_TYPE,
            "subject": [{"name": "payload", "digest": {"sha256": enc.sha256_hex(envelope.payload)}}],
            "predicateType": ENVELOPE_PREDICATE_TYPE, "predicate": {"envelope": envelope_json(envelope)}}


def statement(envelope: Envelope) -> dict[str, JsonValue]:
    """The Statement of a node's envelope (a receipt, a run manifest, or else `envelope_statement`), decoded
    without its signature checked: an exporter's view; a reader checks the signature first (`read_export`,
    then `check_statement`)."""
    try:
        if envelope.payload_type == RECEIPT_PAYLOAD_TYPE:
            return receipt_statement(envelope, Receipt.from_bytes(envelope.payload))
        if envelope.payload_type == RUN_MANIFEST_PAYLOAD_TYPE:
            return manifest_statement(envelope, RunManifest.from_bytes(envelope.payload))
    except InvalidReceipt:
        pass
    return envelope_statement(envelope)


def export(envelope: Envelope, form: str, signing_key: Ed25519PrivateKey | None = None) -> bytes:
    """The exported file's bytes (JSON): `form` "intoto" (the Statement, or a DSSE envelope of it signed by
    `signing_key`) or "sigstore-bundle" (the signed envelope in a bundle; needs `signing_key`)."""
    if form not in FORMATS:
        raise InvalidReceipt(f"--format: expected one of {', '.join(FORMATS)}, got {form!r}")
    doc: dict[str, JsonValue] = statement(envelope)
    if signing_key is not None:
        signed = sign_envelope(INTOTO_PAYLOAD_TYPE, enc.canonical_json(doc), signing_key)
        doc = envelope_json(signed)
        if form == "sigstore-bundle":
            doc = {"mediaType": BUNDLE_MEDIA_TYPE, "dsseEnvelope": doc,
                   "verificationMaterial": {"publicKey": {"hint": signed.keyid}, "tlogEntries": []}}
    elif form == "sigstore-bundle":
        raise InvalidReceipt("a sigstore bundle carries a signed envelope: pass --signing-key",
                             remedy="create one with `detent-audit keygen` (the node's own key works too)")
    return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8") + b"\n"


class Export(NamedTuple):
    """An exported file read back: the node's envelope it carries, the Statement it states, and the exporter's
    envelope around that Statement (None for a bare Statement)."""

    envelope: Envelope
    statement: dict[str, JsonValue]
    outer: Envelope | None


def exported_name(name: str) -> str | None:
    """The node's file name an exported file's name stands for (`X.receipt.intoto.json` -> `X.receipt`);
    None for a name no export has."""
    for suffix in SUFFIXES.values():
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return None


def read_export(path: str | Path) -> Export:
    """Parse an exported file (any outer form) in bounded size; the node's envelope is not yet verified.
    Raises `InvalidReceipt` naming the field."""
    data = dec.read_bounded(path, MAX_EXPORT_BYTES, what="exported receipt")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise InvalidReceipt(f"{Path(path).name}: not JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise InvalidReceipt(f"{Path(path).name}: expected a JSON object")
    outer = None
    if "mediaType" in doc:
        if doc["mediaType"] != BUNDLE_MEDIA_TYPE:
            raise InvalidReceipt(f"bundle.mediaType: expected {BUNDLE_MEDIA_TYPE!r}, got "
                                 f"{doc['mediaType']!r}")
        doc = doc.get("dsseEnvelope")
    if isinstance(doc, dict) and "payloadType" in doc:
        outer = envelope_from_json(doc, "dsseEnvelope")
        if outer.payload_type != INTOTO_PAYLOAD_TYPE:
            raise InvalidReceipt(f"dsseEnvelope.payloadType: expected {INTOTO_PAYLOAD_TYPE!r}, got "
                                 f"{outer.payload_type!r}")
        try:
            doc = json.loads(outer.payload.decode("utf-8"))
        except (ValueError, RecursionError, UnicodeDecodeError):
            raise InvalidReceipt("dsseEnvelope.payload: not a JSON Statement") from None
    if not isinstance(doc, dict) or doc.get("_type") != STATEMENT_TYPE:
        raise InvalidReceipt(f"{Path(path).name}: not an in-toto Statement v1 (`_type` {STATEMENT_TYPE})")
    predicate = doc.get("predicate")
    if not isinstance(predicate, dict):
        raise InvalidReceipt("statement.predicate: expected an object")
    return Export(envelope_from_json(predicate.get("envelope"), "predicate.envelope"), doc, outer)


def check_outer(export: Export, trusted: Mapping[str, Ed25519PublicKey]) -> None:
    """The exporter's signature, checked when its key is among the trusted ones (`BadSignature` if it does not
    verify); an exporter's key that is not trusted adds nothing, the node's signature carries the export."""
    if export.outer is not None and export.outer.keyid in {keyid_of(k) for k in trusted.values()}:
        export.outer.verify(trusted)


def check_statement(export: Export, signed: Receipt | RunManifest) -> None:
    """Every claim of the export is the node's: its Statement equals the one rebuilt from the node's signed
    payload (`signed`, decoded after its signature verified). Raises `BadSignature` (a claim no signature
    covers) naming the first field that differs."""
    if isinstance(signed, Receipt):
        rebuilt = receipt_statement(export.envelope, signed)
    else:
        rebuilt = manifest_statement(export.envelope, signed)
    if export.statement != rebuilt:
        field = next((k for k in sorted(set(rebuilt) | set(export.statement))
                      if export.statement.get(k) != rebuilt.get(k)), "?")
        raise BadSignature(f"the exported Statement's {field!r} is not what the node's signed payload states",
                             remedy="export the node's file again (`detent-audit export`)")
