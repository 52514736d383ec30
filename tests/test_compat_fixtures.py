"""Receipts and run manifests of format v2 as they were committed (tests/fixtures/compat/, signed with a key
for these tests only) verify forever, and each tampered copy fails with the error its name gives: a change
that breaks old receipts, or lets a defect through, cannot land silently. The bytes are read as committed
(tests/fixtures/make_compat_fixtures.py wrote them; rerun it only for an intended format change)."""

from __future__ import annotations

from pathlib import Path

import pytest

from detent_audit.manifests.dsse import Envelope
from detent_audit.manifests.encoding import facts_hash, tuple_hash
from detent_audit.manifests.errors import BadSignature, InvalidManifest, InvalidReceipt, UntrustedKey
from detent_audit.manifests.keys import load_trusted_keys
from detent_audit.manifests.receipt import Receipt, verify_envelope
from detent_audit.manifests.run_manifest import check_run, verify_run_manifest
from detent_audit.verifier.receipt_file import open_receipt
from detent_audit.verifier.runs import check_manifest
from detent_audit.verifier.steps import ERRORS, Step, VerificationError

FIXTURES = Path(__file__).parent / "fixtures" / "compat"
GOLDEN_RECEIPTS = sorted(FIXTURES.glob("golden-*.receipt"))

# tampered receipt -> (the verification step that refutes it, the error it raises there, what its message
# says)
BAD_RECEIPTS = {
    "receipt-flipped-logprob-bit-unsigned": (Step.SIGNATURE, BadSignature,
                                             "does not verify over this payload"),
    "receipt-flipped-signature-bit": (Step.SIGNATURE, BadSignature, "does not verify over this payload"),
    "receipt-truncated-envelope": (Step.READ, InvalidReceipt, "envelope: truncated"),
    "receipt-signed-by-an-untrusted-key": (Step.SIGNATURE, UntrustedKey,
                                           "which is not among the 1 trusted key"),
    "receipt-manifest-payload-type": (Step.SIGNATURE, InvalidReceipt, "envelope.payloadType: expected "
                                      "'application/vnd.detent-audit.receipt.v2+msgpack'"),
    "receipt-flipped-logprob-bit-resigned": (Step.PAYLOAD, InvalidReceipt, "is not the digest of the output"),
    "receipt-wrong-request-digest-resigned": (Step.PAYLOAD, InvalidReceipt,
                                              "request.client.body_sha256: not the SHA-256"),
    "receipt-facts-changed-under-their-hash-resigned": (Step.PAYLOAD, InvalidReceipt,
                                                        "deployment hash does not match the facts"),
    "receipt-wrong-tuple-hash-resigned": (Step.PAYLOAD, InvalidReceipt,
                                          "tuple hash does not match the tuple"),
    "receipt-version-1-resigned": (Step.PAYLOAD, InvalidReceipt, "schema version 1 is not supported"),
    "receipt-unknown-field-resigned": (Step.PAYLOAD, InvalidReceipt, "output: unknown comment"),
    "receipt-non-canonical-key-order-resigned": (Step.PAYLOAD, InvalidReceipt, "not canonical msgpack"),
}
# tampered manifest -> (the verifier's status, what its message says)
BAD_MANIFESTS = {
    "manifest-omits-a-receipt-resigned": ("FAIL",
                                          "the run's final manifest ends it at receipt 1, yet 1 receipt(s)"),
    "manifest-flipped-signature-bit": ("FAIL", "does not verify over this payload"),
    "manifest-truncated-envelope": ("BAD", "envelope: truncated"),
    "manifest-wrong-merkle-root-resigned": ("BAD", "is not the root of the listed digests"),
    "manifest-wrong-receipt-count-resigned": ("BAD", "receipt_count: 4, but there are 3 digests"),
}


@pytest.fixture(scope="module")
def trusted() -> dict:
    return load_trusted_keys(FIXTURES / "test-only-node.key.pub")


@pytest.fixture(scope="module")
def golden(trusted: dict) -> dict[Path, Receipt]:
    return {p: open_receipt(p, trusted) for p in GOLDEN_RECEIPTS}


def test_every_fixture_is_named_here() -> None:
    names = {p.stem for p in FIXTURES.iterdir() if p.suffix in (".receipt", ".manifest")}
    assert names == {p.stem
                     for p in GOLDEN_RECEIPTS} | {"golden-run"} | set(BAD_RECEIPTS) | set(BAD_MANIFESTS)


def test_golden_receipts_verify_and_keep_their_bytes(golden: dict[Path, Receipt], trusted: dict) -> None:
    assert len(golden) == 3
    by_id = {r.request.request_id: r for r in golden.values()}
    assert set(by_id) == {"chat", "completion-top-logprobs", "completion-stop-string"}
    for path, r in golden.items():
        envelope = Envelope.from_bytes(path.read_bytes())
        assert r.to_bytes() == envelope.payload  # decoded and re-encoded: the signed bytes, exactly
        assert verify_envelope(path.read_bytes(), trusted).keyid == r.node_keyid
        assert facts_hash(r.deployment_facts) == r.deployment_hash
        assert tuple_hash(r.tuple_values) == r.tuple_hash
        assert r.request.client.body()["id"] == r.request.request_id  # the client's body, as it was sent
    # what each request exercised is still read back (optional fields included)
    assert by_id["completion-top-logprobs"].output.top_k == 2
    assert by_id["completion-stop-string"].request.sampling.stop == ("e",)
    assert by_id["chat"].request.client.api == "detent/v1/offline-jsonl"
    assert sorted(r.run.seq for r in golden.values()) == [0, 1, 2]


def test_the_golden_manifest_covers_the_golden_run(golden: dict[Path, Receipt], trusted: dict) -> None:
    path = FIXTURES / "golden-run.manifest"
    manifest = verify_run_manifest(path.read_bytes(), trusted).manifest
    check_run(manifest, golden.values())
    assert manifest.kind == "final" and manifest.receipt_count == 3
    outcome, _ = check_manifest(path, trusted, golden)
    assert outcome.status == "OK" and outcome.step is None, outcome.message


@pytest.mark.parametrize("name", sorted(BAD_RECEIPTS))
def test_each_tampered_receipt_fails_with_its_named_error(name: str, trusted: dict) -> None:
    step, error, message = BAD_RECEIPTS[name]
    with pytest.raises(VerificationError) as caught:
        open_receipt(FIXTURES / f"{name}.receipt", trusted)
    got = (caught.value.step, caught.value.message)
    assert type(caught.value) is ERRORS[step] and message in caught.value.message, got
    cause = caught.value.__cause__
    assert type(cause) is error and cause.exit_code == caught.value.exit_code, repr(cause)


@pytest.mark.parametrize("name", sorted(BAD_MANIFESTS))
def test_each_tampered_manifest_fails_with_its_named_error(name: str, golden: dict[Path, Receipt],
                                                           trusted: dict) -> None:
    status, message = BAD_MANIFESTS[name]
    outcome, _ = check_manifest(FIXTURES / f"{name}.manifest", trusted, golden)
    assert (outcome.status, message in outcome.message) == (status, True), outcome.message
    assert outcome.step is Step.MANIFESTS


def test_the_manifest_errors_are_the_manifests_own(trusted: dict) -> None:
    for name in ("manifest-wrong-merkle-root-resigned", "manifest-wrong-receipt-count-resigned"):
        with pytest.raises(InvalidManifest):
            verify_run_manifest((FIXTURES / f"{name}.manifest").read_bytes(), trusted)


def test_golden_receipts_are_refused_at_re_execution_as_an_older_facts_format(golden: dict[Path, Receipt],
                                                                               ) -> None:
    """Their facts are format 1 (a CPU written in the GPU's schema): steps (1)-(6) verify them, and step (7)
    refuses to rebuild their deployment with a verdict that says so, before anything is built."""
    from detent_audit.runtime.facts import FACTS_FORMAT
    from detent_audit.verifier.reconstruct import NotComparable, reconstruct

    assert FACTS_FORMAT == 2
    for r in golden.values():
        assert "format" not in r.deployment_facts and r.deployment_facts["deployment"]["gpu"]["arch"] == "cpu"
        with pytest.raises(NotComparable) as caught:
            reconstruct(r.deployment_facts, r.tuple_values, "no-such-model-is-loaded")
        assert caught.value.fields == ["format.facts"] and caught.value.exit_code == 3
        message = caught.value.message
        assert "older format (1; this verifier rebuilds format 2)" in message, message


def test_verify_reports_the_golden_run_as_not_comparable_by_its_format(tmp_path: Path) -> None:
    import json
    import shutil

    from typer.testing import CliRunner

    from detent_audit.cli import app

    for p in [*GOLDEN_RECEIPTS, FIXTURES / "golden-run.manifest"]:
        shutil.copy(p, tmp_path / p.name.removeprefix("golden-"))
    res = CliRunner().invoke(app, ["verify", str(tmp_path), "--key", str(FIXTURES / "test-only-node.key.pub"),
                                   "--workers", "1", "--json"])
    report = json.loads(res.stdout)
    receipts = [o for o in report["outcomes"] if o["kind"] == "receipt"]
    assert res.exit_code == 3 and len(receipts) == 3, report
    assert all(o["status"] == "NOT_COMPARABLE" and o["fields"] == ["format.facts"] for o in receipts), \
        receipts
    assert [o["status"] for o in report["outcomes"] if o["kind"] != "receipt"] == ["OK"], report
