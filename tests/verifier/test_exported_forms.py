"""`verify` of exported receipts and run manifests (in-toto Statements, signed envelopes, sigstore bundles)
gives the verdicts it gives the node's own files: every compat fixture, and a freshly served run."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.manifests import intoto
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
from detent_audit.verifier.verify import verify

FIXTURES = Path(__file__).parents[1] / "fixtures" / "compat"
runner = CliRunner()


def _verdicts(paths: list[Path], trusted: dict, **kwargs) -> list[tuple]:
    """Each outcome's (node file name, kind, status, step), exported names mapped to the node's."""
    report = verify(paths, trusted, **kwargs)
    return sorted((intoto.exported_name(Path(o.path).name) or Path(o.path).name, o.kind, o.status, o.step)
                  for o in report.outcomes)


def _export(source: Path, out: Path, *extra: str) -> None:
    res = runner.invoke(app, ["export", str(source), "--out", str(out), *extra])
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module")
def exporter_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_key(tmp_path_factory.mktemp("exporter") / "exporter.key").private_path


@pytest.mark.parametrize("form,signed", [("intoto", False), ("intoto", True), ("sigstore-bundle", True)])
def test_every_compat_fixture_gets_the_same_verdict_exported(form: str, signed: bool, exporter_key: Path,
                                                             tmp_path: Path) -> None:
    trusted = load_trusted_keys(FIXTURES / "test-only-node.key.pub")
    extra = ("--format", form, *(("--signing-key", str(exporter_key)) if signed else ()))
    res = runner.invoke(app, ["export", str(FIXTURES), "--out", str(tmp_path / "x"), *extra, "--json"])
    doc = json.loads(res.stdout)
    refused = {Path(r["source"]).name for r in doc["refused"]}
    # only an envelope that cannot be read is refused (nothing signed to carry); verify says BAD at step 1
    assert res.exit_code == 2 and refused == {"receipt-truncated-envelope.receipt",
                                              "manifest-truncated-envelope.manifest"}
    for name in sorted(refused):
        ((_, _, status, _),) = _verdicts([FIXTURES / name], trusted)
        assert status == "BAD"
    files = sorted(p for p in FIXTURES.iterdir()
                   if p.suffix in (".receipt", ".manifest") and p.name not in refused)
    assert len(files) == 19
    for original in files:
        exported = tmp_path / "x" / (original.name + intoto.SUFFIXES[form])
        assert _verdicts([exported], trusted) == _verdicts([original], trusted), original.name
    # the golden run under the node's names (each receipt named after its request): past steps 1-6
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURES / "golden-run.manifest", run / "golden-run.manifest")
    for golden in sorted(FIXTURES.glob("golden-*.receipt")):
        shutil.copy(golden, run / golden.name.removeprefix("golden-"))
    _export(run, tmp_path / "run-x", *extra)
    kept = [p.name for p in sorted((tmp_path / "run-x").iterdir())]
    assert len(kept) == 4 and all(name.endswith(intoto.SUFFIXES[form]) for name in kept)
    original, exported = _verdicts([run], trusted), _verdicts([tmp_path / "run-x"], trusted)
    assert exported == original and {v[2] for v in original} == {"OK", "NOT_COMPARABLE"}


def test_a_served_run_exported_verifies_as_served(exporter_key: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from detent_audit.engine.llm import LLM, EngineConfig
    from detent_audit.server.node import ServingNode
    from detent_audit.server.offline import serve_offline

    monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path / "cache"))
    key = generate_key(tmp_path / "node.key")
    llm = LLM(EngineConfig(model="random:tiny-llama", cache_dir=str(tmp_path / "jit")))
    node = ServingNode(llm, load_private_key(key.private_path), tmp_path / "out")
    lines = [{"prompt_token_ids": [4 + i, 5, 6], "max_tokens": 3, "temperature": 0.8, "seed": i}
             for i in range(3)]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    serve_offline(llm, node, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    node.close()
    trusted = load_trusted_keys(key.public_path)
    served = _verdicts([tmp_path / "out"], trusted, model="random:tiny-llama")
    assert {v[2] for v in served} == {"OK"} and len(served) == 4  # 3 receipts and their final manifest
    _export(tmp_path / "out", tmp_path / "bundles", "--format", "sigstore-bundle", "--signing-key",
            str(exporter_key))
    assert _verdicts([tmp_path / "bundles"], trusted, model="random:tiny-llama") == served
    # one logprob bit of the carried receipt flipped: the node's signature refutes it, as it would the file
    bundle_path = sorted((tmp_path / "bundles" / "receipts").glob("*.sigstore.json"))[0]
    bundle = json.loads(bundle_path.read_text())
    outer = intoto.envelope_from_json(bundle["dsseEnvelope"], "dsseEnvelope")
    statement = json.loads(outer.payload)
    carried = intoto.envelope_from_json(statement["predicate"]["envelope"], "predicate.envelope")
    payload = bytearray(carried.payload)
    payload[-40] ^= 0x01
    tampered = dataclasses.replace(carried, payload=bytes(payload))
    statement["predicate"]["envelope"] = intoto.envelope_json(tampered)
    bundle_path.write_text(json.dumps(statement))  # as a bare Statement
    verdicts = _verdicts([bundle_path], trusted, model="random:tiny-llama")
    assert [(v[2], v[3]) for v in verdicts] == [("FAIL", 2)], verdicts


def test_verify_refuses_an_exports_unsigned_claim_and_a_trusted_exporters_bad_signature(
        tmp_path: Path) -> None:
    trusted = load_trusted_keys(FIXTURES / "test-only-node.key.pub")
    source = tmp_path / "chat.receipt"
    shutil.copy(FIXTURES / "golden-chat.receipt", source)
    _export(source, tmp_path / "x" / "chat.receipt.intoto.json")
    path = tmp_path / "x" / "chat.receipt.intoto.json"
    statement = json.loads(path.read_text())
    statement["predicate"]["buildDefinition"]["externalParameters"]["seed"] += 1  # one the node never signed
    path.write_text(json.dumps(statement))
    (outcome,) = verify([path], trusted).outcomes
    assert (outcome.status, outcome.step) == ("FAIL", 2)
    assert "not what the node's signed payload" in outcome.message
    # the node exporting with its own key: that outer signature is trusted, so checked
    node_key = tmp_path / "node.key"
    shutil.copy(FIXTURES / "test-only-node.key", node_key)
    node_key.chmod(0o600)
    _export(source, path, "--signing-key", str(node_key))
    assert _verdicts([path], trusted) == _verdicts([source], trusted)
    envelope = json.loads(path.read_text())
    sig = envelope["signatures"][0]["sig"]
    envelope["signatures"][0]["sig"] = ("A" if sig[0] != "A" else "B") + sig[1:]
    path.write_text(json.dumps(envelope))
    (outcome,) = verify([path], trusted).outcomes
    assert (outcome.status, outcome.step) == ("FAIL", 2) and "does not verify" in outcome.message
