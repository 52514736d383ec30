"""Receipts and run manifests exported as in-toto Statements and sigstore bundles: read by the upstream
packages' own parsers, lossless, and no claim of an export taken beyond the node's signature."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf import json_format
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.statement import Statement
from sigstore_models.bundle.v1 import Bundle

from detent_audit.manifests import encoding as enc
from detent_audit.manifests import intoto
from detent_audit.manifests.dsse import Envelope
from detent_audit.manifests.errors import BadSignature
from detent_audit.manifests.keys import keyid
from detent_audit.manifests.receipt import Receipt
from detent_audit.manifests.run_manifest import RunManifest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "compat"


def _envelope(name: str) -> Envelope:
    return Envelope.from_bytes((FIXTURES / name).read_bytes())


def _in_toto_parse(statement: dict) -> Statement:
    """The Statement through in-toto-attestation's protobuf binding and its `validate`."""
    pb = json_format.Parse(json.dumps(statement), statement_pb2.Statement())  # type: ignore[attr-defined]
    parsed = Statement.copy_from_pb(pb)
    parsed.validate()
    return parsed


def test_a_receipts_statement_names_what_the_receipt_signed() -> None:
    envelope = _envelope("golden-completion-top-logprobs.receipt")
    receipt = Receipt.from_bytes(envelope.payload)
    st = intoto.statement(envelope)
    parsed = _in_toto_parse(st)
    assert parsed.pb.predicate_type == intoto.RECEIPT_PREDICATE_TYPE
    assert [(s.name, dict(s.digest)) for s in parsed.pb.subject] == [
        (f"response/{receipt.request.request_id}", {"sha256": receipt.output.digest})]
    build, run = st["predicate"]["buildDefinition"], st["predicate"]["runDetails"]
    assert run["builder"]["id"].endswith(receipt.node_keyid)
    assert build["externalParameters"]["request"]["body"] == receipt.request.client.body()
    assert build["externalParameters"]["request"]["body_sha256"] == receipt.request.client.body_sha256
    deps = {d["name"]: d["digest"] for d in build["resolvedDependencies"]}
    assert deps["weights"] == {"sha256": receipt.deployment_facts["checkpoint"]["weights"]}
    assert deps["engine/kernels"] == {"sha256": receipt.deployment_facts["engine"]["sources"]["kernels"]}
    assert run["byproducts"][0]["digest"] == {"sha256": enc.sha256_hex(receipt.output.logprobs_f32le)}
    # lossless: the node's file, byte for byte
    carried = intoto.envelope_from_json(st["predicate"]["envelope"], "predicate.envelope")
    assert carried.to_bytes() == (FIXTURES / "golden-completion-top-logprobs.receipt").read_bytes()


def test_a_run_manifests_statement_parses_and_carries_its_envelope() -> None:
    envelope = _envelope("golden-run.manifest")
    manifest = RunManifest.from_bytes(envelope.payload)
    parsed = _in_toto_parse(intoto.statement(envelope))
    assert parsed.pb.predicate_type == intoto.RUN_MANIFEST_PREDICATE_TYPE
    assert parsed.pb.predicate["merkleRoot"] == manifest.merkle_root


@pytest.mark.parametrize("form", intoto.FORMATS)
def test_a_signed_export_parses_as_dsse_and_as_a_sigstore_bundle(form: str, tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    envelope = _envelope("golden-chat.receipt")
    data = intoto.export(envelope, form, key)
    doc = json.loads(data)
    if form == "sigstore-bundle":
        bundle = Bundle.from_json(data)  # sigstore 4.5's bundle model (sigstore.models.Bundle's inner one)
        assert bundle.media_type == intoto.BUNDLE_MEDIA_TYPE
        assert bundle.verification_material.public_key.hint == keyid(key.public_key())
        assert bundle.verification_material.tlog_entries == []
        assert bundle.dsse_envelope.payload_type == intoto.INTOTO_PAYLOAD_TYPE
        doc = doc["dsseEnvelope"]
    outer = intoto.envelope_from_json(doc, "dsseEnvelope")
    outer.verify({"exporter": key.public_key()})
    _in_toto_parse(json.loads(outer.payload))
    path = tmp_path / f"golden-chat.receipt{intoto.SUFFIXES[form]}"
    path.write_bytes(data)
    read = intoto.read_export(path)
    assert read.envelope == envelope and read.outer == outer


def test_a_sigstore_bundle_needs_a_signing_key() -> None:
    with pytest.raises(Exception, match="pass --signing-key"):
        intoto.export(_envelope("golden-chat.receipt"), "sigstore-bundle")


def test_a_claim_the_node_did_not_sign_is_refused(tmp_path: Path) -> None:
    envelope = _envelope("golden-chat.receipt")
    receipt = Receipt.from_bytes(envelope.payload)
    st = intoto.statement(envelope)
    st["subject"][0]["digest"]["sha256"] = "0" * 64
    path = tmp_path / "chat.receipt.intoto.json"
    path.write_text(json.dumps(st))
    with pytest.raises(BadSignature, match="'subject' is not what the node's signed payload states"):
        intoto.check_statement(intoto.read_export(path), receipt)
    st = intoto.statement(envelope)
    st["predicate"]["buildDefinition"]["externalParameters"]["seed"] += 1
    path.write_text(json.dumps(st))
    with pytest.raises(BadSignature, match="'predicate'"):
        intoto.check_statement(intoto.read_export(path), receipt)


def test_a_trusted_exporters_flipped_signature_bit_is_refused(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    doc = json.loads(intoto.export(_envelope("golden-chat.receipt"), "intoto", key))
    sig = bytearray(base64.b64decode(doc["signatures"][0]["sig"]))
    sig[7] ^= 0x10
    doc["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    path = tmp_path / "chat.receipt.intoto.json"
    path.write_text(json.dumps(doc))
    export = intoto.read_export(path)
    untrusted = Ed25519PrivateKey.generate().public_key()
    intoto.check_outer(export, {"other": untrusted})  # an exporter's key not trusted: not relied on
    with pytest.raises(BadSignature):
        intoto.check_outer(export, {"exporter": key.public_key()})
