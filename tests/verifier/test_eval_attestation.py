"""`verify-eval --attest`: an audit's test-result Statement, read by in-toto-attestation's own parsers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf import json_format
from in_toto_attestation.predicates.test_result.v0 import test_result_pb2
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.statement import Statement

from detent_audit.manifests import intoto
from detent_audit.manifests.dsse import Envelope
from detent_audit.manifests.errors import BadSignature
from detent_audit.verifier.eval_attestation import (
    TEST_RESULT_PREDICATE_TYPE,
    eval_statement,
    write_attestation,
)
from detent_audit.verifier.eval_audit import DocVerdict, EvalReport, Score


def _report(covered: int = 3, recomputed: float = 0.5) -> EvalReport:
    docs = [DocVerdict("qa", i, i < covered, [] if i < covered else ["request 0: no receipt binds the body"])
            for i in range(3)]
    receipts = [{"request_id": f"cmpl-{i}", "sha256": f"{i:064x}", "verdict": "OK"} for i in range(covered)]
    return EvalReport([Score("qa", "acc,none", 0.5, recomputed, covered, 3)], docs, 0,
                      {"OK": covered, "FAIL": 0, "BAD": 0, "NOT_COMPARABLE": 0, "not_opened": 0},
                      documents={"qa": {"run": 3, "task": 50, "limit": 3}},
                      task_configs={"qa": {"sha256": "ab" * 32, "version": 1.0}}, receipts=receipts,
                      inputs={"results_x.json": "cd" * 32, "samples_qa_x.jsonl": "ef" * 32})


def _parsed(statement: dict) -> test_result_pb2.TestResult:  # type: ignore[name-defined]
    pb = json_format.Parse(json.dumps(statement), statement_pb2.Statement())  # type: ignore[attr-defined]
    Statement.copy_from_pb(pb).validate()
    assert pb.predicate_type == TEST_RESULT_PREDICATE_TYPE
    result = test_result_pb2.TestResult()  # type: ignore[attr-defined]
    return json_format.ParseDict(statement["predicate"], result,
                                 ignore_unknown_fields=True)  # scores, coverage, receipts: our extension


def test_a_full_audit_is_passed_with_every_receipt_digest() -> None:
    st = eval_statement(_report())
    result = _parsed(st)
    assert result.result == "PASSED" and list(result.failed_tests) == []
    assert list(result.passed_tests) == ["qa acc,none: reported 0.5, recomputed 0.5, coverage 3/3"]
    (config,) = result.configuration
    assert config.name == "lm-eval-task/qa" and dict(config.digest) == {"sha256": "ab" * 32}
    assert [s["name"] for s in st["subject"]] == ["results_x.json", "samples_qa_x.jsonl"]
    assert [r["digest"]["sha256"] for r in st["predicate"]["receipts"]] == [f"{i:064x}" for i in range(3)]
    assert st["predicate"]["coverage"] == {"covered": 3, "total": 3}


@pytest.mark.parametrize("covered,recomputed", [(2, 0.5), (3, 0.25)])
def test_a_short_coverage_or_another_score_is_failed_and_named(covered: int, recomputed: float) -> None:
    result = _parsed(eval_statement(_report(covered, recomputed)))
    assert result.result == "FAILED" and list(result.passed_tests) == []
    first = result.failed_tests[0]
    assert f"coverage {covered}/3" in first and f"recomputed {recomputed}" in first
    assert ("qa doc 2: request 0: no receipt binds the body" in result.failed_tests) == (covered == 2)


def test_a_signed_attestation_verifies_under_the_verifiers_key_only(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    write_attestation(_report(), tmp_path / "a.json", key)
    outer = intoto.envelope_from_json(json.loads((tmp_path / "a.json").read_text()), "attestation")
    assert outer.payload_type == intoto.INTOTO_PAYLOAD_TYPE
    outer.verify({"verifier": key.public_key()})
    assert json.loads(outer.payload) == eval_statement(_report())
    forged = Envelope(outer.payload_type, outer.payload.replace(b"PASSED", b"FAILED"), outer.keyid,
                             outer.signature)
    with pytest.raises(BadSignature):
        forged.verify({"verifier": key.public_key()})


def test_verify_eval_attest_writes_the_signed_statement_of_its_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's wiring: the report verify-eval prints is the one attested, signed by --attest-key."""
    from typer.testing import CliRunner

    from detent_audit.cli import app
    from detent_audit.manifests.keys import generate_key, load_public_key
    from detent_audit.verifier import eval_audit

    report = _report(covered=2)
    monkeypatch.setattr(eval_audit, "verify_eval", lambda *args, **kwargs: report)
    key = generate_key(tmp_path / "verifier.key")
    node_pub = Path(__file__).parents[1] / "fixtures" / "compat" / "test-only-node.key.pub"
    args = ["verify-eval", str(tmp_path), "--receipts", str(tmp_path), "--key", str(node_pub), "--json",
            "--attest", str(tmp_path / "attestation.json"), "--attest-key", str(key.private_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and json.loads(res.stdout)["coverage"] == {"covered": 2, "total": 3}, res.output
    outer = intoto.envelope_from_json(json.loads((tmp_path / "attestation.json").read_text()), "attestation")
    outer.verify({"verifier": load_public_key(key.public_path)})
    assert json.loads(outer.payload) == eval_statement(report)
    res = CliRunner().invoke(app, args[:-4] + ["--attest-key", str(key.private_path)])
    assert res.exit_code == 2 and "pass --attest FILE too" in res.output
