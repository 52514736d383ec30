"""What a node's folder must account for: a run's manifests cover its sequence numbers from 0 without a gap (a
receipt left out of a re-signed recovery manifest, a manifest removed, a run's end removed), a folder of
receipts carries its manifests, one request id is answered once; where only receipt files are given, the gap
is stated in the verdict. Forged runs from the tests' receipt generator, signed with a fresh key; steps
(7)-(10) (re-execution) are not what these tests check and are skipped."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

import pytest
import receipt_samples
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.manifests.encoding import facts_hash, tuple_hash
from detent_audit.manifests.keys import keyid
from detent_audit.manifests.receipt import Receipt, sign_receipt
from detent_audit.manifests.run_manifest import RunManifest, sign_run_manifest
from detent_audit.verifier import verify as verify_module
from detent_audit.verifier.verify import verify

KEY = Ed25519PrivateKey.generate()
TRUSTED = {keyid(KEY.public_key()): KEY.public_key()}


@pytest.fixture(autouse=True)
def no_reexecution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_module, "_run_batches", lambda *args, **kwargs: [])


def run_of(rng: random.Random, run_id: str, n: int, ids: list[str] | None = None) -> list[Receipt]:
    """`n` receipts of run `run_id` (sequence numbers 0..n-1) whose stated hashes are their content's and
    whose time is now: every check before re-execution passes."""
    base = receipt_samples.random_receipt(rng, KEY)
    facts = base.deployment_facts
    values = {"attention": {"num_splits": rng.randint(1, 64)}, "gemm": {"block_k": rng.choice([32, 64, 128])}}
    out = []
    for i, r in enumerate(receipt_samples.random_run(rng, n, KEY, run_id=run_id)):
        rid = ids[i] if ids else f"{run_id}-{i}-{rng.getrandbits(32):x}"
        request = dataclasses.replace(r.request, request_id=rid)
        out.append(
            dataclasses.replace(
                r,
                deployment_facts=facts,
                deployment_hash=facts_hash(facts),
                tuple_values=values,
                tuple_hash=tuple_hash(values),
                request=request,
                time_unix_ns=time.time_ns(),
            )
        )
    return out


def manifest(
    receipts: list[Receipt], kind: str, seq_first: int | None = None, seq_last: int | None = None
) -> RunManifest:
    """The manifest of `receipts`; a recovery manifest may state a wider range than they span."""
    m = RunManifest.for_receipts(
        receipts,
        run_id=receipts[0].run.run_id,
        node_keyid=receipts[0].node_keyid,
        deployment_hash=receipts[0].deployment_hash,
        tuple_hash=receipts[0].tuple_hash,
        time_unix_ns=time.time_ns(),
        kind=kind,
    )
    return dataclasses.replace(
        m,
        seq_first=m.seq_first if seq_first is None else seq_first,
        seq_last=m.seq_last if seq_last is None else seq_last,
    )


def node_folder(root: Path, receipts: list[Receipt], manifests: list[RunManifest]) -> Path:
    """A node's --manifest-out folder: receipts/ and manifests/, as the node names them."""
    (root / "receipts").mkdir(parents=True, exist_ok=True)
    (root / "manifests").mkdir(parents=True, exist_ok=True)
    for r in receipts:
        (root / "receipts" / f"{r.request.request_id}.receipt").write_bytes(sign_receipt(r, KEY))
    for m in manifests:
        (root / "manifests" / f"{m.run_id}-{m.seq_first:08d}-{m.kind}.manifest").write_bytes(
            sign_run_manifest(m, KEY)
        )
    return root


def refuted(paths: list[Path]) -> list[dict]:
    report = verify(paths, TRUSTED)
    return [o.to_json() for o in report.outcomes if o.status != "OK"]


def test_honest_runs_with_rotations_a_recovery_and_an_unclosed_end_account_for_every_receipt(
    tmp_path,
) -> None:
    """The control: what an honest node writes (rotations then a final; rotations then a killed run's
    recovery; a run killed just after a rotation, which leaves nothing to seal) passes every coverage
    check."""
    rng = random.Random(1)
    a, b, c = run_of(rng, "a" * 32, 10), run_of(rng, "b" * 32, 7), run_of(rng, "c" * 32, 8)
    folder = node_folder(
        tmp_path / "out",
        [*a, *b, *c],
        [
            manifest(a[:4], "rotation"),
            manifest(a[4:8], "rotation"),
            manifest(a[8:], "final"),
            manifest(b[:4], "rotation"),
            manifest(b[4:], "recovery"),
            manifest(c[:4], "rotation"),
            manifest(c[4:], "rotation"),
        ],
    )
    report = verify([folder], TRUSTED)
    assert report.exit_code == 0 and report.coverage.covered == 25 and not report.coverage.gaps, [
        o.to_json() for o in report.outcomes if o.status != "OK"
    ]


def test_a_receipt_left_out_of_a_final_manifest_re_signed_as_a_recovery_manifest_fails(tmp_path) -> None:
    rng = random.Random(2)
    run = run_of(rng, "d" * 32, 10)
    kept = run[:5] + run[6:]
    folder = node_folder(tmp_path / "out", kept, [manifest(kept, "recovery", 0, 9)])
    (bad,) = refuted([folder])
    assert (
        bad["kind"] == "manifest"
        and bad["status"] == "FAIL"
        and "1 of its sequence numbers are in it under no digest (5;" in bad["message"]
    ), bad


@pytest.mark.parametrize("cut", ["first", "middle"])
def test_a_run_whose_manifests_leave_a_sequence_number_out_fails(tmp_path, cut: str) -> None:
    """Receipt 0, or receipt 5, and its manifest's range removed: each manifest is whole, the run is not."""
    rng = random.Random(3)
    run = run_of(rng, "e" * 32, 10)
    if cut == "first":
        kept, manifests = run[1:], [manifest(run[1:5], "rotation"), manifest(run[5:], "final")]
    else:
        kept, manifests = run[:5] + run[6:], [manifest(run[:5], "rotation"), manifest(run[6:], "final")]
    gone = "0" if cut == "first" else "5"
    (bad,) = refuted([node_folder(tmp_path / "out", kept, manifests)])
    assert bad["kind"] == "coverage" and bad["status"] == "FAIL" and bad["path"] == f"run {'e' * 32}", bad
    assert f"account for no receipt numbered {gone} " in bad["message"], bad


@pytest.mark.parametrize("last", ["rotation", "recovery"])
def test_a_clients_receipt_past_the_end_of_its_runs_manifests_fails(tmp_path, last: str) -> None:
    """The node removed a run's last receipts and its final manifest (or re-signed the rest as a recovery):
    the receipt its client kept, verified beside the node's folder, is in none of its run's manifests."""
    rng = random.Random(4)
    run = run_of(rng, "f" * 32, 10)
    folder = node_folder(tmp_path / "out", run[:8], [manifest(run[:4], "rotation"), manifest(run[4:8], last)])
    client = tmp_path / f"{run[9].request.request_id}.receipt"
    client.write_bytes(sign_receipt(run[9], KEY))
    bad = refuted([folder, client])
    assert bad and all(o["status"] == "FAIL" for o in bad), bad
    assert any(
        "receipt(s) 9 given of this run are in none of its 2 manifest(s)" in o["message"] for o in bad
    ), bad


def test_a_folder_of_receipts_without_any_manifest_fails(tmp_path) -> None:
    rng = random.Random(5)
    folder = node_folder(tmp_path / "out", run_of(rng, "0" * 32, 3), [])
    (bad,) = refuted([folder])
    assert bad["kind"] == "coverage" and bad["status"] == "FAIL" and bad["path"] == str(folder), bad
    assert "3 receipt(s) in this folder and no run manifest that verified" in bad["message"], bad
    (receipts_only,) = refuted([folder / "receipts"])
    assert receipts_only["path"] == str(folder / "receipts") and receipts_only["status"] == "FAIL", (
        receipts_only
    )


def test_one_request_id_answered_in_two_runs_fails(tmp_path) -> None:
    """The same offline request id answered by two runs, each run whole and sealed, one of its receipts moved
    to a folder of its own inside the node's folder (or two folders given together). Given as two files
    alone, it is a stated gap: separate jobs may reuse ids."""
    rng = random.Random(6)
    first, second = run_of(rng, "1" * 32, 3, ["q0", "q1", "q2"]), run_of(rng, "2" * 32, 2, ["q7", "q1"])
    one = node_folder(tmp_path / "one", first, [manifest(first, "final")])
    two = node_folder(tmp_path / "one" / "again", second, [manifest(second, "final")])
    three = node_folder(tmp_path / "three", second, [manifest(second, "final")])
    for paths in ([one], [one / "receipts", one / "manifests", three]):
        bad = refuted(paths)
        assert [o["path"] for o in bad] == ["request q1"], bad
        assert bad[0]["status"] == "FAIL" and "'q1' is answered in 2 runs" in bad[0]["message"], bad
    report = verify([one / "receipts" / "q1.receipt", two / "receipts" / "q1.receipt"], TRUSTED)
    assert report.exit_code == 0 and any("'q1' is answered in 2 runs" in g for g in report.coverage.gaps), (
        report.coverage
    )


def test_receipt_files_given_alone_verify_with_the_coverage_gap_stated_in_the_verdict(tmp_path) -> None:
    rng = random.Random(7)
    run = run_of(rng, "3" * 32, 4)
    folder = node_folder(tmp_path / "out", run, [manifest(run, "final")])
    files = sorted((folder / "receipts").glob("*.receipt"))[:2]
    pub = tmp_path / "node.pub"
    pub.write_bytes(KEY.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    res = CliRunner().invoke(app, ["verify", *map(str, files), "--key", str(pub)])
    verdict = [line for line in res.stdout.splitlines() if " ok, " in line]
    assert res.exit_code == 0 and len(verdict) == 1, res.stdout
    assert "coverage not shown: 2 receipt(s) checked without a run manifest of their run" in verdict[0], (
        verdict
    )
    res = CliRunner().invoke(app, ["verify", *map(str, files), "--key", str(pub), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["coverage"]["gaps"], res.stdout
    res = CliRunner().invoke(app, ["verify", str(folder), "--key", str(pub), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["coverage"]["gaps"] == [], res.stdout


def test_a_recovery_manifest_over_the_whole_64_bit_range_is_refused_in_seconds(tmp_path) -> None:
    rng = random.Random(8)
    run = run_of(rng, "9" * 32, 2)
    folder = node_folder(tmp_path / "out", run, [manifest(run, "recovery", 0, (1 << 64) - 1)])
    start = time.perf_counter()
    (bad,) = refuted([folder])
    assert time.perf_counter() - start < 5.0
    assert bad["kind"] == "manifest" and f"{(1 << 64) - 2} of its sequence numbers" in bad["message"], bad
    assert "(2, 3, 4, 5, 6, ...;" in bad["message"], bad
