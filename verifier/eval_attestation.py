"""`verify-eval --attest`: an audited lm-eval run as an in-toto Statement with the test-result predicate
(https://github.com/in-toto/attestation/blob/main/spec/predicates/test-result.md), signed by the verifier's
own key when one is given (a DSSE envelope, as `manifests/intoto.py` writes them).

    subject:   the lm-eval files audited (results_*.json, samples_*.jsonl), each by its SHA-256
    predicate: {result: PASSED|FAILED (verify-eval's exit code 0 or not),
                configuration: per task its rebuilt config's SHA-256 (lm-eval's hash_string), its version,
                passedTests: the scores recomputed equal over every document,
                failedTests: the scores that differ or rest on fewer documents, each document not covered and
                             each problem of the run, with its reason,
                scores, coverage, receipts: the reported and recomputed scores, the documents covered, and
                             every receipt the scores rest on (request id, SHA-256 of its payload, verdict)}

`scores`, `coverage` and `receipts` extend the predicate (in-toto's parsing rules: a consumer ignores
fields it does not know).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import sign_envelope
from detent_audit.manifests.intoto import INTOTO_PAYLOAD_TYPE, STATEMENT_TYPE, envelope_json
from detent_audit.verifier.eval_audit import EvalReport, Score

TEST_RESULT_PREDICATE_TYPE = "https://in-toto.io/attestation/test-result/v0.1"


def _score_line(s: Score) -> str:
    return (f"{s.task} {s.metric}: reported {s.reported}, recomputed {s.recomputed}, "
            f"coverage {s.covered}/{s.total}")


def eval_statement(report: EvalReport) -> dict[str, object]:
    """The test-result Statement of a verify-eval report (module docstring)."""
    passed = [_score_line(s) for s in report.scores if s.equal and s.covered == s.total]
    failed = [_score_line(s) for s in report.scores if not (s.equal and s.covered == s.total)]
    failed += [f"{d.task} doc {d.doc_id}: {'; '.join(d.reasons)}" for d in report.docs if not d.covered]
    failed += list(report.problems)
    covered = sum(d.covered for d in report.docs)
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digest}}
                    for name, digest in sorted(report.inputs.items())],
        "predicateType": TEST_RESULT_PREDICATE_TYPE,
        "predicate": {
            "result": "PASSED" if report.exit_code == 0 else "FAILED",
            "configuration": [{"name": f"lm-eval-task/{task}", "digest": {"sha256": c["sha256"]},
                               "annotations": {"version": c["version"], **report.documents.get(task, {})}}
                              for task, c in sorted(report.task_configs.items())],
            "passedTests": passed, "warnedTests": [], "failedTests": failed,
            "scores": [s.to_json() for s in report.scores],
            "coverage": {"covered": covered, "total": len(report.docs)},
            "receipts": [{"name": r["request_id"], "digest": {"sha256": r["sha256"]}, "verdict": r["verdict"]}
                         for r in report.receipts],
            "publishedDeployments": list(report.published),
        },
    }


def write_attestation(report: EvalReport, path: Path, key: Ed25519PrivateKey | None = None) -> None:
    """Write the Statement to `path` (JSON), in a DSSE envelope signed by `key` when one is given."""
    doc: Mapping[str, object] = eval_statement(report)
    if key is not None:
        doc = envelope_json(sign_envelope(INTOTO_PAYLOAD_TYPE, enc.canonical_json(doc), key))
    path.write_text(enc.canonical_json(doc).decode("ascii") + "\n")
