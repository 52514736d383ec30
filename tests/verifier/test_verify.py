"""`detent-audit verify` on receipts served offline from a tiny checkpoint: pass in both modes; tampering
(re-signed with the node's key) fails at the right position; a different deployment is not comparable, with
the differing fields named; bad input is exit 2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
from detent_audit.manifests.receipt import (
    ClientRequest,
    OutputRecord,
    RunRecord,
    sign_receipt,
    verify_envelope,
)
from detent_audit.runtime.tuples import save_tuple
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import serve_offline

runner = CliRunner()


@pytest.fixture(scope="module")
def served(new_node) -> dict:
    root, ckpt, key, llm, node = new_node("served", rotate=4)
    lines = [{"id": f"r{i}", "prompt_token_ids": list(range(3 + i, 12 + 2 * i)), "max_tokens": 6,
              "temperature": [0.0, 0.9, 0.7][i % 3], "top_p": [1.0, 1.0, 0.9][i % 3], "seed": 100 + i,
              "ignore_eos": True} for i in range(10)]
    (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    serve_offline(llm, node, root / "in.jsonl", root / "out.jsonl")
    node.close()
    return {"root": root, "ckpt": ckpt, "key": key, "out": root / "out", "jit": root / "jit",
            "tokenizer": llm.tokenizer}


def _output(served_or_tokenizer, tokens, logprobs, finish, tops=()) -> OutputRecord:
    """An output record whose text is the tokens' text (what the server returns)."""
    tok = served_or_tokenizer["tokenizer"] if isinstance(served_or_tokenizer, dict) else served_or_tokenizer
    return OutputRecord.from_floats(tokens, logprobs, finish, tok.decode(list(tokens)), tops)


def _renamed(r, name: str):
    """`r` as the receipt of request `name` (its bound body's id too), to be saved as `name`.receipt."""
    body = {**r.request.client.body(), "id": name}
    client = ClientRequest.of(r.request.client.api, body)
    return dataclasses.replace(r, request=dataclasses.replace(r.request, request_id=name, client=client),
                               run=RunRecord(f"forged-{name}", 0))


def _bound(r, **sampling):
    """`r`'s request with its sampling changed, and the client's bound body changed to ask for it."""
    body = r.request.client.body()
    body.update({k: list(v) if isinstance(v, tuple) else v for k, v in sampling.items()})
    return dataclasses.replace(r.request, client=ClientRequest.of(r.request.client.api, body),
                               sampling=dataclasses.replace(r.request.sampling, **sampling))


def _verify(served: dict, *paths: Path, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", *map(str, paths), "--key", str(served["key"].public_path), "--model",
                              str(served["ckpt"]), "--cache-dir", str(served["jit"]), "--json", *extra])
    return res.exit_code, json.loads(res.stdout)


def _receipt(served: dict, name: str):
    """A served receipt, opened and signature-checked."""
    path = served["out"] / "receipts" / f"{name}.receipt"
    return verify_envelope(path.read_bytes(), load_trusted_keys(served["key"].public_path)).receipt


def _tuple_with_chunk(r, rows: int) -> dict:
    """The receipt's per-family tuple with the GEMM chunk set to `rows`."""
    values = {k: dict(v) for k, v in r.tuple_values.items() if k != "mode"}
    values["embedded.gemm"] = {**values["embedded.gemm"], "chunk_rows": rows,
                               "embedded.gemm.chunk_rows": rows}
    return values


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_served_receipts_verify(served, mode: str) -> None:
    code, report = _verify(served, served["out"], extra=("--mode", mode))
    assert code == 0, report
    # 10 receipts, 3 manifests
    assert report["counts"] == {"OK": 13, "FAIL": 0, "BAD": 0, "NOT_COMPARABLE": 0}


def _tampered(served: dict, tmp_path: Path, change) -> Path:
    src = served["out"] / "receipts" / "r4.receipt"

    r = verify_envelope(src.read_bytes(), load_trusted_keys(served["key"].public_path)).receipt
    tokens, lps = change(list(r.output.token_ids), list(r.output.logprobs))
    forged = dataclasses.replace(r, output=_output(served, tokens, lps, r.output.finish_reason))
    path = tmp_path / "r4.receipt"
    path.write_bytes(sign_receipt(forged, load_private_key(served["key"].private_path)))
    return path


def _flip_bit(values: list[float], i: int) -> list[float]:
    import struct

    bits = struct.unpack("<I", struct.pack("<f", values[i]))[0] ^ 1
    values[i] = struct.unpack("<f", struct.pack("<I", bits))[0]
    return values


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_one_logprob_bit_changed_fails_at_its_position(served, tmp_path, mode: str) -> None:
    path = _tampered(served, tmp_path, lambda t, lp: (t, _flip_bit(lp, 3)))
    code, report = _verify(served, path, extra=("--mode", mode))
    assert code == 1
    (o,) = report["outcomes"]
    assert o["status"] == "FAIL" and o["divergence"]["position"] == 3 and o["divergence"]["ulp"] == 1
    assert o["divergence"]["what"] == "logprob"


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_one_output_token_changed_fails_at_its_position(served, tmp_path, mode: str) -> None:
    path = _tampered(served, tmp_path, lambda t, lp: (t[:2] + [(t[2] + 1) % 256] + t[3:], lp))
    code, report = _verify(served, path, extra=("--mode", mode))
    assert code == 1
    assert report["outcomes"][0]["divergence"]["position"] == 2


def test_truncated_output_fails(served, tmp_path) -> None:
    path = _tampered(served, tmp_path, lambda t, lp: (t[:4], lp[:4]))
    code, report = _verify(served, path)
    assert code == 1 and "finish 'length' after 4 of max_tokens=6" in report["outcomes"][0]["message"]


def test_other_weights_are_not_comparable(served, make_checkpoint) -> None:
    other = make_checkpoint("tiny-llama", seed=5)
    res = runner.invoke(app, ["verify", str(served["out"] / "receipts" / "r1.receipt"), "--key",
                              str(served["key"].public_path), "--model", str(other), "--json"])
    assert res.exit_code == 3
    assert json.loads(res.stdout)["outcomes"][0]["fields"] == ["checkpoint.weights"]


def test_other_thread_count_is_not_comparable(served) -> None:
    code, report = _verify(served, served["out"] / "receipts" / "r1.receipt", extra=("--threads", "2"))
    assert code == 3
    assert report["outcomes"][0]["fields"] == ["runtime.num_threads"]  # compared before building


def test_other_tuple_is_not_comparable(served, tmp_path) -> None:

    r = _receipt(served, "r1")
    served_rows = r.tuple_values["embedded.gemm"]["chunk_rows"]  # the probe's choice on this CPU (8 or 16)
    values = _tuple_with_chunk(r, 16 if served_rows != 16 else 8)
    save_tuple(values, tmp_path / "other.tuple")
    code, report = _verify(served, served["out"] / "receipts" / "r1.receipt",
                           extra=("--tuple", str(tmp_path / "other.tuple")))
    assert code == 3
    # the knob a pinned chunk overrides is not signed; the params the kernels get are
    fields = {"tuple.embedded.gemm.chunk_rows", "kernel_params.gemm"}
    # what the probe proved differs too
    if r.tuple_values["embedded.gemm"].get("embedded.gemm.form") == "pad":
        fields.add("deployment.engine.gemm_pad_rows")
    assert set(report["outcomes"][0]["fields"]) == fields


def test_another_gemm_form_is_not_comparable(served, tmp_path) -> None:
    """The same rows in another form (pad against chunk) is another tuple: verify names the form."""
    r = _receipt(served, "r1")
    values = {k: dict(v) for k, v in r.tuple_values.items() if k != "mode"}
    form = values["embedded.gemm"].get("embedded.gemm.form", "chunk")
    values["embedded.gemm"] = {**values["embedded.gemm"], "chunk_rows": 4, "embedded.gemm.chunk_rows": 4,
                               "embedded.gemm.form": "chunk" if form == "pad" else "pad"}
    save_tuple(values, tmp_path / "other-form.tuple")
    code, report = _verify(served, served["out"] / "receipts" / "r1.receipt",
                           extra=("--tuple", str(tmp_path / "other-form.tuple")))
    assert code == 3
    assert "tuple.embedded.gemm.embedded.gemm.form" in report["outcomes"][0]["fields"]


def test_untrusted_key_and_garbage_are_refused(served, tmp_path) -> None:
    other = generate_key(tmp_path / "other.key")
    res = runner.invoke(app, ["verify", str(served["out"] / "receipts" / "r1.receipt"), "--key",
                              str(other.public_path)])
    assert res.exit_code == 1 and "FAIL:" in res.stdout
    junk = tmp_path / "junk.receipt"
    junk.write_bytes(b"\x93not a receipt")
    res = runner.invoke(app, ["verify", str(junk), "--key", str(served["key"].public_path)])
    assert res.exit_code == 2
    res = runner.invoke(app, ["verify", str(junk)])
    assert res.exit_code == 2 and "exactly one of --key" in res.stderr
    (tmp_path / "empty").mkdir()
    receipt = (served["out"] / "receipts" / "r1.receipt").read_bytes()
    (tmp_path / "empty" / "renamed.msgpack").write_bytes(receipt)
    res = runner.invoke(app, ["verify", str(tmp_path / "empty"), "--key", str(served["key"].public_path)])
    # nothing checked is no pass
    assert res.exit_code == 2 and "no *.receipt or *.manifest files" in res.stdout
    res = runner.invoke(app, ["verify", str(served["out"]), "--key", str(served["key"].public_path.parent)])
    assert res.exit_code == 2 and "--trusted-keys" in res.stderr
    for extra, says in ((("--threads", "0"), "--threads"), (("--seed", "3"), "--seed")):
        key = str(served["key"].public_path)
        res = runner.invoke(app, ["verify", str(served["out"]), "--key", key, *extra])
        assert res.exit_code == 2 and says in res.stderr, res.output


def test_manifest_with_a_missing_receipt_fails(served, tmp_path) -> None:
    manifest = sorted((served["out"] / "manifests").glob("*.manifest"))[0]
    code, report = _verify(served, manifest)  # the manifest alone: its receipts are absent
    (o,) = report["outcomes"]
    assert code == 1 and "missing" in o["message"]
    from detent_audit.manifests.run_manifest import verify_run_manifest

    listed = verify_run_manifest(manifest.read_bytes(), load_trusted_keys(served["key"].public_path)).manifest
    assert o["missing"] == sorted(listed.receipt_digests) and o["missing"][0] in o["message"]


def test_receipts_of_a_generated_model_verify_without_a_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path / "cache"))
    key = generate_key(tmp_path / "node.key")
    llm = LLM(EngineConfig(model="random:tiny-llama", cache_dir=str(tmp_path / "jit")))
    node = ServingNode(llm, load_private_key(key.private_path), tmp_path / "out")
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_token_ids": [4, 5, 6], "max_tokens": 3}) + "\n")
    serve_offline(llm, node, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    node.close()
    res = runner.invoke(app, ["verify", str(tmp_path / "out"), "--key", str(key.public_path), "--json",
                              "--model", "random:tiny-llama"])
    assert res.exit_code == 0, res.output


def test_workers_give_the_verdicts_of_one_process(served, tmp_path) -> None:
    """Re-execution spread over processes, each an engine of the receipt's own deployment: the same verdicts,
    a tampered receipt failing at the same position, whatever the worker count."""
    import shutil

    folder = tmp_path / "mixed"
    shutil.copytree(served["out"] / "receipts", folder)
    forged = _tampered(served, tmp_path, lambda t, lp: (t, _flip_bit(lp, 1)))
    shutil.move(forged, folder / "r4.receipt")  # in place of the real r4
    files = sorted(folder.glob("*.receipt"))  # the receipts alone (a folder of receipts needs its manifests)
    code, one = _verify(served, *files)
    assert code == 1
    for workers in ("2", "3"):
        code, many = _verify(served, *files, extra=("--workers", workers))
        assert code == 1 and many == one
    (fail,) = [o for o in one["outcomes"] if o["status"] != "OK"]
    assert fail["path"].endswith("r4.receipt") and fail["divergence"]["position"] == 1
    assert one["counts"]["OK"] == 9


def test_workers_report_a_deployment_mismatch_and_refuse_a_bad_count(served) -> None:
    code, report = _verify(served, served["out"], extra=("--threads", "2", "--workers", "2"))
    assert code == 3
    fields = {tuple(o["fields"]) for o in report["outcomes"] if o["kind"] == "receipt"}
    assert fields == {("runtime.num_threads",)}
    key = str(served["key"].public_path)
    res = runner.invoke(app, ["verify", str(served["out"]), "--key", key, "--workers", "0"])
    assert res.exit_code == 2 and "workers" in res.stderr


def test_auto_workers_follow_cores_receipts_threads_and_memory(served) -> None:
    """`--workers auto`: one worker per core at the receipts' thread count, no more than full batches of
    receipts or engines the memory holds, and one for GPU receipts."""
    from detent_audit.verifier.plan import BATCH, auto_workers, engine_bytes

    r = _receipt(served, "r0")
    facts = r.deployment_facts
    assert facts["runtime"]["num_threads"] == 1 and facts["runtime"]["device"] == "cpu"
    lots = 1 << 40
    assert auto_workers(4 * BATCH, [facts], cores=2, available_memory=lots) == 2
    assert auto_workers(4 * BATCH, [facts], cores=16, available_memory=lots) == 4       # the receipts
    assert auto_workers(BATCH - 1, [facts], cores=16, available_memory=lots) == 1       # under one batch
    # 4-thread engines
    assert auto_workers(64 * BATCH, [facts], threads=4, cores=16, available_memory=lots) == 4
    engine = engine_bytes(facts)
    assert auto_workers(64 * BATCH, [facts], cores=16, available_memory=3 * engine + 1) == 3  # the memory
    assert auto_workers(64 * BATCH, [facts], cores=16, available_memory=engine // 2) == 1
    gpu = {**facts, "runtime": {**facts["runtime"], "device": {"name": "NVIDIA H200"}}}
    assert auto_workers(64 * BATCH, [facts, gpu], cores=16, available_memory=lots) == 1
    # the estimate grows with the model: the weights of the receipt's shape in its dtype, plus the overhead
    model = facts["deployment"]["model"]
    wider_model = {**model, "hidden_size": 2 * model["hidden_size"]}
    wider = {**facts, "deployment": {**facts["deployment"], "model": wider_model}}
    assert engine_bytes(wider) > engine
    key = str(served["key"].public_path)
    res = runner.invoke(app, ["verify", str(served["out"]), "--key", key, "--workers", "x"])
    assert res.exit_code == 2 and "workers" in res.stderr


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_a_response_that_filled_the_context_verifies_and_an_impossible_one_fails_alone(
        make_checkpoint, tmp_path, mode: str) -> None:
    """A response whose prompt and output fill max_model_len verifies in both modes; a receipt the deployment
    could not have served (longer than its context, signed by the node) fails on its own, and the receipts
    batched with it are still checked."""
    ckpt = make_checkpoint("tiny-llama")
    key = generate_key(tmp_path / "node.key")
    llm = LLM(EngineConfig(model=str(ckpt), mode="detent", max_model_len=64, cache_dir=str(tmp_path / "jit")))
    node = ServingNode(llm, load_private_key(key.private_path), tmp_path / "out")
    lines = [{"id": "full", "prompt_token_ids": list(range(5, 45)), "max_tokens": 24, "temperature": 0.8,
              "seed": 3, "ignore_eos": True},
             {"id": "short", "prompt_token_ids": [7, 8, 9], "max_tokens": 5, "ignore_eos": True}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    serve_offline(llm, node, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    node.close()
    base = ["verify", str(tmp_path / "out"), "--key", str(key.public_path), "--model", str(ckpt),
            "--cache-dir", str(tmp_path / "jit"), "--json", "--mode", mode]
    res = runner.invoke(app, base)
    assert res.exit_code == 0, res.output

    r = verify_envelope((tmp_path / "out" / "receipts" / "full.receipt").read_bytes(),
                        load_trusted_keys(key.public_path)).receipt
    r = _renamed(r, "longer")
    body = {**r.request.client.body(), "prompt_token_ids": list(range(5, 70))}
    longer = dataclasses.replace(r.request, prompt_token_ids=tuple(range(5, 70)),
                                 client=ClientRequest.of(r.request.client.api, body))
    (tmp_path / "out" / "receipts" / "longer.receipt").write_bytes(
        sign_receipt(dataclasses.replace(r, request=longer), load_private_key(key.private_path)))
    res = runner.invoke(app, [base[0], str(tmp_path / "out" / "receipts"), *base[2:]])
    assert res.exit_code == 1, res.output
    outcomes = {Path(o["path"]).stem: o for o in json.loads(res.stdout)["outcomes"]}
    assert outcomes["full"]["status"] == outcomes["short"]["status"] == "OK"
    # no front end of a 64-token context admits a 65-token prompt with 24 tokens to come: the finish rule
    # (step 8: the context is full at output token 0) or the request binding (step 9) refutes it
    message = outcomes["longer"]["message"]
    assert outcomes["longer"]["status"] == "FAIL", outcomes["longer"]
    assert ("admits the client's request" in message
            or "finishes generation (max_model_len)" in message), message


def test_a_tuple_illegal_for_the_solved_pins_is_not_comparable(served, tmp_path) -> None:
    """Step (4): a receipt whose signed tuple is not legal for the solved pins, and a --tuple that is not, are
    exit 3 with "tuple" named, and the message says whose tuple it was."""
    from detent_audit.manifests.encoding import tuple_hash

    r = _receipt(served, "r1")
    values = _tuple_with_chunk(r, 512)
    save_tuple(values, tmp_path / "illegal.tuple")
    code, report = _verify(served, served["out"] / "receipts" / "r1.receipt",
                           extra=("--tuple", str(tmp_path / "illegal.tuple")))
    (o,) = report["outcomes"]
    assert code == 3 and o["fields"] == ["tuple"] and "the --tuple given is not legal" in o["message"], o
    signed_values = {**values, "mode": dict(r.tuple_values["mode"])}
    forged = dataclasses.replace(r, tuple_values=signed_values, tuple_hash=tuple_hash(signed_values))
    path = tmp_path / "r1.receipt"
    path.write_bytes(sign_receipt(forged, load_private_key(served["key"].private_path)))
    code, report = _verify(served, path)
    (o,) = report["outcomes"]
    assert code == 3 and o["fields"] == ["tuple"] and "the receipt's tuple is not legal" in o["message"], o


def test_facts_this_machine_cannot_rebuild_are_reported_per_receipt(served, tmp_path) -> None:
    """A GPU receipt on a CPU-only machine is not comparable (runtime.device named); facts that are not facts
    (a thread count as text, absurd or missing) are bad input; neither stops the other receipts' checks."""
    import shutil

    import torch

    from detent_audit.manifests.encoding import facts_hash

    folder = tmp_path / "mixed"
    shutil.copytree(served["out"] / "receipts", folder)
    r = verify_envelope((folder / "r1.receipt").read_bytes(),
                        load_trusted_keys(served["key"].public_path)).receipt
    key = load_private_key(served["key"].private_path)

    def forge(name: str, **runtime) -> None:
        facts = json.loads(json.dumps(r.deployment_facts, default=dict))
        facts["runtime"].update(runtime)
        for k, v in runtime.items():
            if v is None:
                del facts["runtime"][k]
        forged = dataclasses.replace(_renamed(r, name), deployment_facts=facts,
                                     deployment_hash=facts_hash(facts))
        (folder / f"{name}.receipt").write_bytes(sign_receipt(forged, key))

    forge("gpu", device="NVIDIA H200 sm90 132 SMs cuda 13.0 triton 3.6.0")
    forge("text-threads", num_threads="2")
    forge("many-threads", num_threads=10**6)
    forge("no-threads", num_threads=None)
    code, report = _verify(served, *sorted(folder.glob("*.receipt")))
    by = {Path(o["path"]).stem: o for o in report["outcomes"]}
    assert [by[f"r{i}"]["status"] for i in range(10)] == ["OK"] * 10
    for name in ("text-threads", "many-threads", "no-threads"):
        assert by[name]["status"] == "BAD" and "num_threads" in by[name]["message"], by[name]
    if not torch.cuda.is_available():
        gpu = by["gpu"]
        assert gpu["status"] == "NOT_COMPARABLE" and gpu["fields"] == ["runtime.device"], gpu
        assert code == 2  # bad input outranks not comparable


def test_fifos_and_unlistable_folders_are_bad_input_never_a_hang_or_a_silent_skip(served, tmp_path,
                                                                                   monkeypatch) -> None:
    """A FIFO named like a receipt or a key is refused without blocking; a folder that cannot be listed is
    reported (a receipt inside it would otherwise be skipped while the run passes)."""
    import os
    import shutil
    import threading

    folder = tmp_path / "hostile"
    shutil.copytree(served["out"], folder)  # the node's folder: its receipts and manifests
    os.mkfifo(folder / "x.receipt")
    os.mkfifo(tmp_path / "fifo.pub")
    locked = folder / "locked"
    locked.mkdir()
    shutil.copy(folder / "receipts" / "r1.receipt", locked / "in.receipt")
    real_scandir = os.scandir

    def scandir(path=".", *args):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path, *args)

    monkeypatch.setattr(os, "scandir", scandir)
    results: dict = {}

    def run() -> None:
        results["folder"] = _verify(served, folder)
        results["key"] = runner.invoke(app, ["verify", str(folder / "receipts" / "r1.receipt"), "--key",
                                             str(tmp_path / "fifo.pub")])

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "verify blocked on a FIFO"
    code, report = results["folder"]
    by = {o["path"]: o for o in report["outcomes"]}
    assert code == 2
    fifo = by[str(folder / "x.receipt")]
    assert fifo["status"] == "BAD" and "not a regular file" in fifo["message"]
    assert by[str(locked)]["status"] == "BAD" and "cannot list" in by[str(locked)]["message"]
    assert results["key"].exit_code == 2 and "not a regular file" in results["key"].stderr


def _forge_all(served, tmp_path, name: str, change) -> Path:
    """r0's receipt (greedy, 6 tokens, ignore_eos) changed by `change(receipt) -> receipt`, re-signed."""

    r = _receipt(served, "r0")
    (tmp_path / name).mkdir()
    path = tmp_path / name / "r0.receipt"
    forged = dataclasses.replace(change(r), run=RunRecord(f"forged-{name}", 0))
    path.write_bytes(sign_receipt(forged, load_private_key(served["key"].private_path)))
    return path


def _with(r, tokens, logprobs, finish, tokenizer=None, **sampling):
    request = _bound(r, **sampling) if sampling else r.request
    text = tokenizer.decode(list(tokens)) if tokenizer is not None else ""
    return dataclasses.replace(r, request=request,
                               output=OutputRecord.from_floats(tokens, logprobs, finish, text))


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_a_node_cannot_forge_the_finish_reason_or_feed_ids_outside_the_vocabulary(served, tmp_path,
                                                                                 mode: str) -> None:
    """Signed by the node, the served tokens and logprob bits, but: 'length' where a stop token ended the
    output (a stop wins), or an output id the model has no row for. Both FAIL, in both modes, beside the
    honest 'stop' version of the same cut, which passes; nothing crashes."""
    folder = tmp_path / "forged"
    folder.mkdir()

    def cut(finish, **sampling):
        def change(r):
            tokens, lps = list(r.output.token_ids), list(r.output.logprobs)
            return _with(r, tokens[:3], lps[:3], finish, served["tokenizer"], stop_token_ids=(tokens[2],),
                         **sampling)
        return change

    r0_tokens = None

    def oov(r):
        nonlocal r0_tokens
        r0_tokens = list(r.output.token_ids)
        return _with(r, r0_tokens[:-1] + [10**6], list(r.output.logprobs), r.output.finish_reason)

    for name, change in (("stop-honest", cut("stop")), ("length-at-stop", cut("length")),
                         ("length-at-stop-max", cut("length", max_tokens=3)), ("oov", oov)):
        _forge_all(served, folder, name, change)
    if len(set(r0_tokens[:3])) < 3:  # the cut is honest only where its stop token first appears at the end
        pytest.skip("r0's first tokens repeat")
    code, report = _verify(served, folder, extra=("--mode", mode))
    by = {Path(o["path"]).parent.name: o for o in report["outcomes"]}
    assert by["stop-honest"]["status"] == "OK", by["stop-honest"]
    for name in ("length-at-stop", "length-at-stop-max"):
        assert by[name]["status"] == "FAIL" and "so it finished with 'stop'" in by[name]["message"], by[name]
    assert by["oov"]["status"] == "FAIL" and "outside the model's vocabulary" in by["oov"]["message"]
    assert code == 1


def test_stock_receipts_are_not_comparable(served, make_checkpoint, tmp_path) -> None:
    """Stock kernels read the batch: no verifier can rebuild the batch a request was served in, so stock
    receipts are not comparable (and their facts do not claim batch invariance)."""
    ckpt = make_checkpoint("tiny-llama")
    key = generate_key(tmp_path / "node.key")
    llm = LLM(EngineConfig(model=str(ckpt), mode="stock", cache_dir=str(served["jit"])))
    assert llm.deployment.engine.batch_invariant is False
    node = ServingNode(llm, load_private_key(key.private_path), tmp_path / "out")
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_token_ids": [4, 5, 6], "max_tokens": 3}))
    serve_offline(llm, node, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    node.close()
    (receipt,) = (tmp_path / "out" / "receipts").glob("*.receipt")
    res = runner.invoke(app, ["verify", str(receipt), "--key", str(key.public_path), "--model",
                              str(ckpt), "--json"])
    (o,) = json.loads(res.stdout)["outcomes"]
    assert res.exit_code == 3 and o["fields"] == ["tuple.mode.name"] and "not batch-invariant" in o["message"]
    save_tuple(LLM(EngineConfig(model=str(ckpt), cache_dir=str(served["jit"]))).selection.tuple,
               tmp_path / "t")
    res = runner.invoke(app, ["verify", str(receipt), "--key", str(key.public_path), "--model",
                              str(ckpt), "--tuple", str(tmp_path / "t"), "--json"])
    (o,) = json.loads(res.stdout)["outcomes"]
    assert res.exit_code == 2 and "--tuple applies to detent receipts only" in o["message"], o


def test_a_response_cut_by_the_context_and_a_request_longer_than_the_default_kv_pool_verify(make_checkpoint,
                                                                                          tmp_path) -> None:
    """Honest receipts the verifier used to refuse: 'length' where prompt and output fill max_model_len (a
    prompt and max_tokens beyond it are refused by both front ends, so a receipt of one FAILs: see
    test_receipts.py), and a request needing more KV blocks than the default pool (block size 1); both modes
    pass."""
    ckpt = make_checkpoint("tiny-llama")
    key = generate_key(tmp_path / "node.key")
    for name, overrides, prompt, max_tokens in (("context", {"max_model_len": 64}, list(range(3, 60)), 7),
                                                ("pool", {"block_size": 1, "num_kv_blocks": 4096},
                                                 [(7 * i) % 250 for i in range(1500)], 3)):
        llm = LLM(EngineConfig(model=str(ckpt), mode="detent", cache_dir=str(tmp_path / "jit"), **overrides))
        node = ServingNode(llm, load_private_key(key.private_path), tmp_path / name)
        from detent_audit.runtime.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.7, seed=5, max_tokens=max_tokens, ignore_eos=True)
        (out,) = llm.generate([prompt], params)
        assert out.finish_reason == "length"
        node.sign(out, params, name, ClientRequest.of("detent/v1/offline-jsonl", {
            "id": name, "prompt_token_ids": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": 5,
            "ignore_eos": True}))
        node.close()
        for mode in ("rescore", "replay"):
            res = runner.invoke(app, ["verify", str(tmp_path / name), "--key", str(key.public_path),
                                      "--model", str(ckpt), "--cache-dir", str(tmp_path / "jit"),
                                      "--mode", mode])
            assert res.exit_code == 0, (name, mode, res.output)


def test_a_checkpoint_with_another_eos_set_is_not_comparable(served, tmp_path) -> None:
    """The EOS ids decide which finishes are legal: generation_config.json, which can add some, is among the
    checkpoint's hashed files, so a verifier whose copy stops on other ids is told which file differs."""
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(served["ckpt"], copy)
    gen = json.loads((copy / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    gen["eos_token_id"] = eos + [87]
    (copy / "generation_config.json").write_text(json.dumps(gen))
    res = runner.invoke(app, ["verify", str(served["out"] / "receipts" / "r1.receipt"), "--key",
                              str(served["key"].public_path), "--model", str(copy), "--json"])
    (o,) = json.loads(res.stdout)["outcomes"]
    assert res.exit_code == 3 and o["fields"] == ["checkpoint.tokenizer.generation_config.json"], o


def test_an_empty_output_and_a_tuple_its_facts_do_not_record_fail(served, tmp_path) -> None:
    """The engine draws at least one token for every request it admits, so an empty output FAILs (even where
    the prompt fills the context); the tuple a receipt signs must be its facts' mode and per-family tuple."""
    from detent_audit.manifests.encoding import tuple_hash

    folder = tmp_path / "forged"
    folder.mkdir()

    def retuple(values):
        return lambda r: dataclasses.replace(r, tuple_values=values, tuple_hash=tuple_hash(values))

    def empty(prompt_len):
        def change(r):
            request = dataclasses.replace(r.request,
                                          prompt_token_ids=tuple(3 + i % 300 for i in range(prompt_len)))
            return dataclasses.replace(r, request=request, output=OutputRecord.from_floats([], [], "length"))
        return change

    _forge_all(served, folder, "empty", empty(5))
    _forge_all(served, folder, "empty-full", empty(2048))
    _forge_all(served, folder, "mode-only", retuple({"mode": {"name": "detent"}}))
    _forge_all(served, folder, "extra-key",
               lambda r: retuple({**{k: dict(v) for k, v in r.tuple_values.items()},
                                                               "mode": {"name": "detent", "junk": 7}})(r))
    for mode in ("rescore", "replay"):
        code, report = _verify(served, folder, extra=("--mode", mode))
        by = {Path(o["path"]).parent.name: o for o in report["outcomes"]}
        assert code == 1 and all(o["status"] == "FAIL" for o in by.values()), by
        assert all("an empty output" in by[name]["message"] for name in ("empty", "empty-full"))
        for name in ("mode-only", "extra-key"):
            assert "not the one its deployment facts record" in by[name]["message"], by[name]


def test_a_sample_is_unpredictable_unless_its_seed_is_given_and_a_run_answers_each_request_once(
        served, tmp_path) -> None:
    """--sample draws its seed at random and reports it; --seed repeats that sample. A run manifest whose
    receipts answer one request id twice (a node keeping the draw it liked) FAILs."""

    seeds, picks = set(), {}
    for _ in range(3):
        code, report = _verify(served, served["out"], extra=("--sample", "0.3"))
        assert code == 0 and report["sample_seed"] is not None
        seeds.add(report["sample_seed"])
        picks[report["sample_seed"]] = sorted(o["path"] for o in report["outcomes"])
    assert len(seeds) == 3  # 64-bit draws
    seed, paths = next(iter(picks.items()))
    code, again = _verify(served, served["out"], extra=("--sample", "0.3", "--seed", str(seed)))
    assert again["sample_seed"] == seed and sorted(o["path"] for o in again["outcomes"]) == paths

    from detent_audit.manifests.run_manifest import RunManifest, sign_run_manifest

    trusted = load_trusted_keys(served["key"].public_path)
    a, b = (verify_envelope((served["out"] / "receipts" / f"r{i}.receipt").read_bytes(), trusted).receipt
            for i in (1, 2))
    a = dataclasses.replace(a, run=RunRecord("twice", 0))
    b_as_a = dataclasses.replace(b, request=dataclasses.replace(b.request, request_id=a.request.request_id),
                                 run=RunRecord("twice", 1))
    folder = tmp_path / "twice"
    (folder / "again").mkdir(parents=True)
    key = load_private_key(served["key"].private_path)
    (folder / "r1.receipt").write_bytes(sign_receipt(a, key))
    (folder / "again" / "r1.receipt").write_bytes(sign_receipt(b_as_a, key))
    manifest = RunManifest.for_receipts([a, b_as_a], run_id="twice", node_keyid=a.node_keyid,
                                        deployment_hash=a.deployment_hash, tuple_hash=a.tuple_hash,
                                        time_unix_ns=a.time_unix_ns)
    (folder / "run.manifest").write_bytes(sign_run_manifest(manifest, key))
    code, report = _verify(served, folder)
    (m,) = [o for o in report["outcomes"] if o["kind"] == "manifest"]
    assert code == 1 and m["status"] == "FAIL" and "answered more than once" in m["message"], m


def test_replay_holds_a_request_whose_max_tokens_exceeds_the_default_kv_pool(
        make_checkpoint, tmp_path) -> None:
    """Replay reserves prompt + max_tokens blocks (within the context) even when a stop token ends it early:
    the rebuilt pool is sized for that, not for the output's length."""
    ckpt = make_checkpoint("tiny-llama")
    key = generate_key(tmp_path / "node.key")
    llm = LLM(EngineConfig(model=str(ckpt), mode="detent", cache_dir=str(tmp_path / "jit"), block_size=1,
                           num_kv_blocks=3000))
    from detent_audit.runtime.sampling_params import SamplingParams

    (probe,) = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=1500, stop_token_ids=(probe.token_ids[1],),
                            ignore_eos=True)
    (out,) = llm.generate([[9, 8, 7]], params)
    assert out.finish_reason == "stop" and len(out.token_ids) <= 2
    node = ServingNode(llm, load_private_key(key.private_path), tmp_path / "out")
    node.sign(out, params, "early-stop", ClientRequest.of("detent/v1/offline-jsonl", {
        "id": "early-stop", "prompt_token_ids": [9, 8, 7], "max_tokens": 1500,
        "stop_token_ids": [probe.token_ids[1]], "ignore_eos": True}))
    node.close()
    for mode in ("rescore", "replay"):
        res = runner.invoke(app, ["verify", str(tmp_path / "out"), "--key", str(key.public_path), "--model",
                                  str(ckpt), "--cache-dir", str(tmp_path / "jit"), "--mode", mode])
        assert res.exit_code == 0, (mode, res.output)


def test_one_receipt_cannot_size_another_groups_kv_pool(served, tmp_path, monkeypatch) -> None:
    """The rebuilt engine's KV pool follows its own group's longest receipt, capped at its model's context: a
    signed receipt claiming a huge max_tokens (in facts of its own) sizes no other engine, and its own engine
    stays within the context."""
    import shutil

    import detent_audit.verifier.reexecute as reexecute_module
    from detent_audit.manifests.encoding import facts_hash
    from detent_audit.verifier.verify import verify

    folder = tmp_path / "mixed"
    shutil.copytree(served["out"] / "receipts", folder)
    r = _receipt(served, "r1")
    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    facts["deployment"]["engine"]["max_model_len"] = 200_000
    r = _renamed(r, "huge")
    request = dataclasses.replace(r.request,
                                  sampling=dataclasses.replace(r.request.sampling, max_tokens=4_000_000))
    forged = dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts),
                                 request=request)
    (folder / "huge.receipt").write_bytes(sign_receipt(forged, load_private_key(served["key"].private_path)))
    seen: dict[str, tuple[int, int]] = {}
    real = reexecute_module.reconstruct

    def recording(facts, *args, kv_tokens=0, **kwargs):
        llm = None
        try:
            llm = real(facts, *args, kv_tokens=kv_tokens, **kwargs)
            return llm
        finally:
            blocks = None if llm is None else llm.runner.kv_caches[0][0].shape[0]
            seen[facts["deployment"]["engine"]["max_model_len"]] = (kv_tokens, blocks)

    monkeypatch.setattr(reexecute_module, "reconstruct", recording)
    report = verify(sorted(folder.glob("*.receipt")), load_trusted_keys(served["key"].public_path),
                    model=served["ckpt"], mode="replay", cache_dir=str(served["jit"]))
    statuses = {Path(o.path).stem: o.status for o in report.outcomes}
    assert statuses.pop("huge") == "NOT_COMPARABLE" and set(statuses.values()) == {"OK"}
    honest_tokens, honest_blocks = seen[r.deployment_facts["deployment"]["engine"]["max_model_len"]]
    assert honest_tokens < 100 and honest_blocks == EngineConfig.num_kv_blocks
    huge_tokens, _ = seen[200_000]
    assert huge_tokens > 4_000_000
    capped = LLM(EngineConfig(model=str(served["ckpt"]), cache_dir=str(served["jit"]), block_size=1,
                              kv_pool_tokens=huge_tokens))
    # the context, no more
    assert capped.scheduler.config.num_blocks == capped.scheduler.config.max_model_len + 2


def test_each_refutation_names_the_step_that_made_it(served, tmp_path) -> None:
    """One forged file per step (a folder each, so each is alone in its run): the JSON outcome names the step
    of docs/design.md section 7 that refuted it, and the honest receipt passes every step."""
    from detent_audit.manifests.dsse import Envelope
    from detent_audit.manifests.encoding import tuple_hash

    src = served["out"] / "receipts"
    folder = tmp_path / "forged"
    folder.mkdir()
    (folder / "read").mkdir()
    (folder / "read" / "r0.receipt").write_bytes(b"\x93not a receipt")
    data = bytearray((src / "r0.receipt").read_bytes())
    at = bytes(data).index(Envelope.from_bytes(bytes(data)).payload) + 20
    data[at] ^= 1  # one payload bit after signing: the envelope still decodes
    (folder / "signature").mkdir()
    (folder / "signature" / "r0.receipt").write_bytes(bytes(data))
    (folder / "claims").mkdir()
    (folder / "claims" / "r0.receipt").write_bytes((src / "r1.receipt").read_bytes())  # r1 under r0's name
    detent = {"mode": {"name": "detent"}}
    _forge_all(served, folder, "deployment", lambda r: dataclasses.replace(r, tuple_values=detent,
                                                                            tuple_hash=tuple_hash(detent)))
    _forge_all(served, folder, "output", lambda r: _with(r, list(r.output.token_ids)[:-1] + [10**6],
                                                         list(r.output.logprobs), r.output.finish_reason))
    _forge_all(served, folder, "request", lambda r: dataclasses.replace(r, request=dataclasses.replace(
        r.request, sampling=dataclasses.replace(r.request.sampling, temperature=0.5))))
    _forge_all(served, folder, "bits", lambda r: _with(r, list(r.output.token_ids), _flip_bit(
        list(r.output.logprobs), 2), r.output.finish_reason, served["tokenizer"]))
    _forge_all(served, folder, "honest", lambda r: r)
    code, report = _verify(served, *sorted(folder.rglob("*.receipt")))  # the receipts alone, each its own run
    by = {Path(o["path"]).parent.name: o for o in report["outcomes"]}
    assert code == 1
    assert by.pop("honest")["step"] is None
    for name, o in sorted(by.items()):
        assert o["step"]["name"] == name and o["status"] in ("FAIL", "BAD"), o
    assert {n: o["step"]["number"] for n, o in by.items()} == {
        "read": 1, "signature": 2, "claims": 4, "deployment": 7, "output": 8, "request": 9, "bits": 10}
    assert by["read"]["status"] == "BAD" and by["bits"]["divergence"]["position"] == 2
