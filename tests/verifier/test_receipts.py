"""What a receipt proves, tried as a node holding the trusted key would: each forgery below is re-signed with
the node's own key, and `verify` must refuse it (numbers: the defects these tests hold)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.engine.deployment_facts import collect_facts
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.encoding import facts_hash
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
from detent_audit.manifests.receipt import (
    OutputRecord,
    RunRecord,
    sign_receipt,
    verify_envelope,
)
from detent_audit.manifests.run_manifest import RunManifest, sign_run_manifest
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import serve_offline

runner = CliRunner()
API = "detent/v1/offline-jsonl"


@pytest.fixture(scope="module")
def node_run(new_node) -> dict:
    root, ckpt, key, llm, node = new_node("receipts")
    node.publish(root / "deployment.json")
    lines = [{"id": "long", "prompt_token_ids": list(range(5, 25)), "max_tokens": 64, "ignore_eos": True},
             {"id": "sampled", "prompt_token_ids": [9, 8, 7, 6, 5], "max_tokens": 6, "temperature": 0.9,
              "seed": 11, "ignore_eos": True, "logprobs": 3}]
    (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    serve_offline(llm, node, root / "in.jsonl", root / "out.jsonl")
    node.close()
    return {"root": root, "ckpt": ckpt, "key": key, "llm": llm, "out": root / "out",
            "private": load_private_key(key.private_path)}


def _receipt(run: dict, name: str):
    path = run["out"] / "receipts" / f"{name}.receipt"
    return verify_envelope(path.read_bytes(), load_trusted_keys(run["key"].public_path)).receipt


def _save(run: dict, folder: Path, receipt, name: str | None = None) -> Path:
    """`receipt` re-signed by the node, in a folder of its own, named for its request (or `name`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or receipt.request.request_id}.receipt"
    path.write_bytes(sign_receipt(receipt, run["private"]))
    return path


def _verify(run: dict, *paths: Path, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", *map(str, paths), "--key", str(run["key"].public_path), "--model",
                              str(run["ckpt"]), "--cache-dir", str(run["root"] / "jit"), "--json", *extra])
    return res.exit_code, json.loads(res.stdout)


def _receipt_outcome(report: dict) -> dict:
    (o,) = [o for o in report["outcomes"] if o["kind"] == "receipt"]
    return o


def _output(run: dict, tokens, logprobs, finish, tops=()) -> OutputRecord:
    return OutputRecord.from_floats(tokens, logprobs, finish, run["llm"].tokenizer.decode(list(tokens)), tops)


def test_the_honest_receipts_verify_and_say_whose_request_they_are(node_run, tmp_path) -> None:
    for mode in ("rescore", "replay"):
        code, report = _verify(node_run, node_run["out"], extra=("--mode", mode))
        assert code == 0, report
        assert report["facts_self_asserted"] is True and report["coverage"]["uncovered"] == []
        published = str(node_run["root"] / "deployment.json")
        code, report = _verify(node_run, node_run["out"], extra=("--mode", mode, "--deployment", published))
        assert code == 0 and report["facts_self_asserted"] is False
        assert len(report["published_deployments"]) == 1
    res = runner.invoke(app, ["verify", str(node_run["out"]), "--key", str(node_run["key"].public_path),
                              "--model", str(node_run["ckpt"]), "--cache-dir", str(node_run["root"] / "jit")])
    assert res.exit_code == 0 and "request long" in res.stdout and "facts are self-asserted" in res.stdout
    assert "coverage: 2 of 2 receipts in 1 run manifest(s)" in res.stdout


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_1_truncation_by_a_lied_max_model_len_fails(node_run, tmp_path, mode: str) -> None:
    """The client asked max_tokens=64; the node returns 5 tokens, 'length', and facts claiming max_model_len =
    prompt + 5, a signed run manifest too. No front end of that deployment admits the request: FAIL; and
    against the published deployment the facts are not the published ones."""
    r = _receipt(node_run, "long")
    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    facts["deployment"]["engine"]["max_model_len"] = len(r.request.prompt_token_ids) + 5
    cut = _output(node_run, r.output.token_ids[:5], r.output.logprobs[:5], "length")
    forged = dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts), output=cut)
    path = _save(node_run, tmp_path / "cut" / "receipts", forged)
    manifest = RunManifest.for_receipts([forged], run_id=forged.run.run_id, node_keyid=forged.node_keyid,
                                        deployment_hash=forged.deployment_hash, tuple_hash=forged.tuple_hash,
                                        time_unix_ns=forged.time_unix_ns)
    (tmp_path / "cut" / "run.manifest").write_bytes(sign_run_manifest(manifest, node_run["private"]))
    code, report = _verify(node_run, tmp_path / "cut", extra=("--mode", mode))
    o = _receipt_outcome(report)
    assert code == 1 and o["status"] == "FAIL" and "admits the client's request" in o["message"], o
    code, report = _verify(node_run, path, extra=("--mode", mode, "--deployment",
                                                  str(node_run["root"] / "deployment.json")))
    o = _receipt_outcome(report)
    assert code == 1 and "not among the 1 published deployment" in o["message"], o


def _forgeries(run: dict) -> dict:
    long, sampled = _receipt(run, "long"), _receipt(run, "sampled")
    llm = run["llm"]
    # another prompt, computed honestly, under the client's request
    other = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, seed=long.request.seed)
    (out,) = llm.generate([other], params)
    other_request = dataclasses.replace(long.request, prompt_token_ids=tuple(other))
    other_prompt = dataclasses.replace(long, request=other_request,
                                       output=_output(run, out.token_ids, out.logprobs, out.finish_reason))
    # greedy where the client asked temperature 0.9, seed 11 (and the greedy output honestly computed)
    s = sampled.request.sampling
    greedy_params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True, seed=11,
                                   logprobs=3)
    (g,) = llm.generate([list(sampled.request.prompt_token_ids)], greedy_params)
    greedy = dataclasses.replace(
        sampled,
        request=dataclasses.replace(sampled.request, sampling=dataclasses.replace(s, temperature=0.0)),
        output=_output(run, g.token_ids, g.logprobs, g.finish_reason, g.top_logprobs))
    # max_tokens lowered to the truncation point
    lowered = dataclasses.replace(
        long, request=dataclasses.replace(long.request, sampling=dataclasses.replace(long.request.sampling,
                                                                                      max_tokens=5)),
        output=_output(run, long.output.token_ids[:5], long.output.logprobs[:5], "length"))
    # a stop token id the client never sent, ending the output early
    t = long.output.token_ids
    stop = next(i for i in range(2, len(t)) if t[i] not in t[:i])
    extra_stop = dataclasses.replace(
        long, request=dataclasses.replace(long.request, sampling=dataclasses.replace(
            long.request.sampling, stop_token_ids=(t[stop],))),
        output=_output(run, t[:stop + 1], long.output.logprobs[:stop + 1], "stop"))
    # the text returned, and one top alternative's logprob bit
    other_text = dataclasses.replace(sampled,
                                     output=dataclasses.replace(sampled.output, text="another answer"))
    bits = bytearray(sampled.output.top_logprobs_f32le)
    bits[4] ^= 1
    tops = OutputRecord(sampled.output.token_ids, sampled.output.logprobs_f32le, sampled.output.finish_reason,
                        sampled.output.text, sampled.output.top_token_ids, bytes(bits))
    other_tops = dataclasses.replace(sampled, output=tops)
    return {"other-prompt": (other_prompt, "is not the client's request"),
            "greedy": (greedy, "temperature"),
            "lowered-max-tokens": (lowered, "max_tokens 5 where the client asked 64"),
            "extra-stop": (extra_stop, "stop_token_ids"), "other-text": (other_text, "text returned"),
            "other-top-logprob": (other_tops, "top-3 alternatives returned differ")}


@pytest.mark.parametrize("mode", ["rescore", "replay"])
def test_2_a_receipt_binds_the_request_as_the_client_sent_it_and_the_text_and_alternatives_returned(
        node_run, tmp_path, mode: str) -> None:
    forgeries = _forgeries(node_run)
    for name, (receipt, _) in forgeries.items():
        _save(node_run, tmp_path / name, receipt)
    code, report = _verify(node_run, tmp_path, extra=("--mode", mode))
    by = {Path(o["path"]).parent.name: o for o in report["outcomes"] if o["kind"] == "receipt"}
    assert set(by) == set(forgeries)
    for name, (_, fragment) in forgeries.items():
        assert by[name]["status"] == "FAIL" and fragment in by[name]["message"], (name, by[name])
    assert code == 1


def test_8_verify_never_builds_a_model_a_receipt_names(node_run, tmp_path, monkeypatch) -> None:
    """Facts claiming random:llama-3.2-1b: not comparable, from the facts alone, before any engine is built;
    the engine built is always the verifier's own --model."""
    import detent_audit.engine.llm as llm_module  # the embedded engine's rebuild builds an LLM

    r = _receipt(node_run, "long")
    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    facts["checkpoint"] = {"generated": "random:llama-3.2-1b", "config": "0" * 64,
                           "eos_token_ids": facts["checkpoint"]["eos_token_ids"]}
    path = _save(node_run, tmp_path / "big", dataclasses.replace(r, deployment_facts=facts,
                                                                  deployment_hash=facts_hash(facts)))
    built = []
    real = llm_module.LLM
    monkeypatch.setattr(llm_module, "LLM", lambda config: built.append(config.model) or real(config))
    from detent_audit.verifier.verify import verify

    report = verify([path], load_trusted_keys(node_run["key"].public_path), model=node_run["ckpt"],
                    cache_dir=str(node_run["root"] / "jit"))
    (o,) = report.outcomes
    assert o.status == "NOT_COMPARABLE" and "checkpoint.generated" in o.fields and built == [], (o, built)
    report = verify([node_run["out"] / "receipts" / "long.receipt"],
                    load_trusted_keys(node_run["key"].public_path), model=node_run["ckpt"],
                    cache_dir=str(node_run["root"] / "jit"))
    assert report.exit_code == 0 and built == [str(node_run["ckpt"])]


def test_9_a_receipt_under_another_requests_file_name_fails_and_the_text_names_requests(
        node_run, tmp_path) -> None:
    folder = tmp_path / "renamed"
    folder.mkdir()
    (folder / "sampled.receipt").write_bytes((node_run["out"] / "receipts" / "long.receipt").read_bytes())
    code, report = _verify(node_run, folder / "sampled.receipt")
    o = _receipt_outcome(report)
    assert code == 1 and o["status"] == "FAIL" and "receipt of request 'long'" in o["message"], o
    res = runner.invoke(app, ["verify", str(node_run["out"] / "receipts" / "sampled.receipt"), "--key",
                              str(node_run["key"].public_path), "--model", str(node_run["ckpt"]),
                              "--cache-dir", str(node_run["root"] / "jit")])
    assert res.exit_code == 0 and "request sampled" in res.stdout, res.stdout


def test_10_claims_no_bit_can_confirm_are_bounded_or_not_signed(node_run, tmp_path) -> None:
    """A signing time of 0 or 2**64 - 1 FAILs; the prefill chunk (which changes no bit) is not a fact, so a
    receipt claiming one is not comparable, the field named."""
    r = _receipt(node_run, "long")
    for name, t in (("zero", 0), ("max", 2**64 - 1)):
        path = _save(node_run, tmp_path / name, dataclasses.replace(r, time_unix_ns=t))
        code, report = _verify(node_run, path)
        o = _receipt_outcome(report)
        assert code == 1 and "no node signed it then" in o["message"], o
    assert "max_prefill_chunk" not in collect_facts(node_run["llm"])["scheduler"]
    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    facts["scheduler"]["max_prefill_chunk"] = 8
    path = _save(node_run, tmp_path / "chunk", dataclasses.replace(r, deployment_facts=facts,
                                                                    deployment_hash=facts_hash(facts)))
    code, report = _verify(node_run, path)
    o = _receipt_outcome(report)
    assert code == 3 and o["fields"] == ["scheduler.max_prefill_chunk"], o


def _forged_tuple(run: dict, folder: Path, r, change_tuple=None, change_facts=None) -> Path:
    """`r` with its tuple (in the facts and as signed) and facts changed, hashes recomputed, re-signed: what a
    node holding the key can sign."""
    from detent_audit.manifests.encoding import tuple_hash

    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    values = {k: dict(v) for k, v in r.tuple_values.items()}
    if change_tuple:
        change_tuple(values)
        facts["tuple"] = {k: v for k, v in values.items() if k != "mode"}
    if change_facts:
        change_facts(facts)
    return _save(run, folder,
                 dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts),
                                                  tuple_values=values, tuple_hash=tuple_hash(values)))


def test_10_a_tuple_axis_no_kernel_reads_is_not_signed_and_a_receipt_naming_one_is_not_comparable(
        node_run, tmp_path) -> None:
    """The receipt's tuple is what the kernels read: each axis of the loaded assignment that changes no
    kernel's params (every legal value of it tried over the probe, and the bits of a forward pass compared)
    is left out of what is signed, and a receipt that names one, with any value, is refused."""
    import torch

    from detent_audit.runtime.kernel_select import _kernel_set, probe_inputs, probe_params

    llm = node_run["llm"]
    selection = llm.selection
    r = _receipt(node_run, "long")
    signed = {k: dict(v) for k, v in r.tuple_values.items() if k != "mode"}
    assert signed == selection.used_tuple
    assert json.loads(json.dumps(r.deployment_facts["kernel_params"],
                                 default=dict)) == selection.kernel_params
    dead = [(f, a) for f, axes in selection.tuple.items() for a in axes if a not in signed[f]]
    assert dead, "the default assignment has axes a pin overrides (the GEMM chunk knob at least)"
    selectors = {f: res.selector(selection.tuple[f]) for f, res in selection.results.items()}
    base = probe_params(_kernel_set(selectors), probe_inputs(llm.deployment))
    for family, axis in dead:
        result = selection.results[family]
        values = next(x.legal_values for x in (*result.pins, *result.knobs) if x.name == axis)
        legal = [v for v in values if result.is_legal({**selection.tuple[family], axis: v})]
        assert len(legal) > 1
        for v in legal:  # every legal value: the kernels get the same params
            other = result.selector({**selection.tuple[family], axis: v})
            assert probe_params(_kernel_set({**selectors, family: other}),
                                probe_inputs(llm.deployment)) == base
        v = next(v for v in legal if v != selection.tuple[family][axis])
        path = _forged_tuple(node_run, tmp_path / f"{family}-{axis}", r,
                             lambda t, f=family, a=axis, v=v: t[f].__setitem__(a, v))
        code, report = _verify(node_run, path)
        o = _receipt_outcome(report)
        assert code == 3 and o["fields"] == [f"tuple.{family}.{axis}"], o
    # and the bits: an engine loaded with every such axis changed computes the same logits, bit for bit
    changed = {f: dict(a) for f, a in selection.tuple.items()}
    for family, axis in dead:
        result = selection.results[family]
        values = next(x.legal_values for x in (*result.pins, *result.knobs) if x.name == axis)
        changed[family][axis] = next(v for v in values if v != changed[family][axis]
                                     and result.is_legal({**changed[family], axis: v}))
    other = LLM(EngineConfig(model=str(node_run["ckpt"]), mode="detent",
                             cache_dir=str(node_run["root"] / "jit"), tuple=changed))
    assert other.selection.used_tuple == selection.used_tuple
    prompt = torch.randint(0, 256, (23,)).tolist()
    output = list(torch.randint(0, 256, (9,)).tolist())
    assert torch.equal(torch.tensor(llm.rescore(prompt, output)), torch.tensor(other.rescore(prompt, output)))


def test_10_claims_the_bits_cannot_confirm_are_refused_against_the_published_deployment(
        node_run, tmp_path) -> None:
    """A GEMM chunk the node did not use, the params the kernels got, and the scheduler's max_num_seqs, each
    re-signed with the trusted key: where the bits do not refute them (a chunk of 8 or 16 rows gives the same
    bits on some CPUs; max_num_seqs changes none), `verify` says the facts are self-asserted, and against the
    published deployment each is refused."""
    r = _receipt(node_run, "long")
    published = ("--deployment", str(node_run["root"] / "deployment.json"))
    chunk = r.tuple_values["embedded.gemm"]["chunk_rows"]
    other = 8 if chunk != 8 else 16

    def chunk_everywhere(facts):
        facts["kernel_params"]["gemm"] = [{**p, "chunk_rows": other} for p in facts["kernel_params"]["gemm"]]

    forgeries = {
        "chunk": _forged_tuple(node_run, tmp_path / "chunk", r,
                               lambda t: t["embedded.gemm"].__setitem__("chunk_rows", other),
                               chunk_everywhere),
        "seqs": _forged_tuple(node_run, tmp_path / "seqs", r, change_facts=lambda f: f["deployment"]["engine"]
                              .__setitem__("max_num_seqs", 1)),
    }
    for name, path in forgeries.items():
        code, report = _verify(node_run, path)
        o = _receipt_outcome(report)
        # passes as self-asserted, or the bits refute it, or (the GEMM's pad form) the fact its probe proved
        # for the signed rows differs
        assert ((code == 0 and report["facts_self_asserted"] is True)
                or (code == 1 and "bits" in o["message"])
                or (code == 3 and o["fields"]
                    and all(f.startswith("deployment.engine.gemm_") for f in o["fields"]))), \
            (name, o)
        code, report = _verify(node_run, path, extra=published)
        o = _receipt_outcome(report)
        assert code == 1 and "not among the 1 published deployment" in o["message"], (name, o)
    # the params the kernels got, changed alone (the tuple left as signed): the rebuilt engine's kernels get
    # the tuple's, so the receipt is not comparable
    path = _forged_tuple(node_run, tmp_path / "params", r, change_facts=chunk_everywhere)
    code, report = _verify(node_run, path)
    o = _receipt_outcome(report)
    assert code == 3 and o["fields"] == ["kernel_params.gemm"], o
    # the text report names what no bit confirms
    res = runner.invoke(app, ["verify", str(forgeries["seqs"]), "--key", str(node_run["key"].public_path),
                              "--model", str(node_run["ckpt"]), "--cache-dir", str(node_run["root"] / "jit")])
    assert "facts are self-asserted" in res.stdout and "signing times" in res.stdout, res.stdout


def test_10_the_node_signs_nothing_when_its_kernels_ran_with_params_its_facts_do_not_state(node_run, tmp_path
                                                                                          ) -> None:
    from detent_audit.errors import DetentError
    from detent_audit.kernels import GemmParams

    llm = node_run["llm"]
    node = ServingNode(llm, node_run["private"], tmp_path / "out")
    params = SamplingParams(max_tokens=2, seed=1, ignore_eos=True)
    (output,) = llm.generate([[5, 6, 7]], params)
    from detent_audit.manifests.receipt import ClientRequest

    client = ClientRequest.of(API,
                              {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "seed": 1, "ignore_eos": True})
    node.sign(output, params, "fine", client)
    stated = {p["chunk_rows"] for p in node.facts["kernel_params"]["gemm"]}
    stray = GemmParams(chunk_rows=next(c for c in (8, 16, 32) if c not in stated))
    llm.selection.kernels.called["gemm"].add(stray)
    try:
        with pytest.raises(DetentError, match="params the signed facts do not state"):
            node.sign(output, params, "stray", client)
    finally:
        llm.selection.kernels.called["gemm"].discard(stray)
    assert not (tmp_path / "out" / "receipts" / "stray.receipt").exists()
    node.close()


def test_11_a_flipped_weight_byte_changes_the_weights_hash_even_with_its_mtime_restored(
        make_checkpoint, tmp_path, monkeypatch) -> None:
    import shutil

    from detent_audit.runtime.facts import checkpoint_hashes

    monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("tiny-llama"), ckpt)
    before = checkpoint_hashes(ckpt)["weights"]
    assert checkpoint_hashes(ckpt)["weights"] == before  # cached
    weights = next(ckpt.glob("*.safetensors"))
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(st.st_size - 1)
        last = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([last[0] ^ 1]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns and weights.stat().st_size == st.st_size
    assert checkpoint_hashes(ckpt)["weights"] != before


def test_12_trusted_key_folders_skip_and_report_junk_and_a_pub_holds_one_key(node_run, tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "node.pub").write_bytes(node_run["key"].public_path.read_bytes())
    (keys / "junk.pub").write_text("not a key")
    (keys / "dir.pub").mkdir()
    res = runner.invoke(app, ["verify", str(node_run["out"] / "receipts" / "long.receipt"), "--trusted-keys",
                              str(keys), "--model", str(node_run["ckpt"]), "--cache-dir",
                              str(node_run["root"] / "jit"), "--json"])
    assert res.exit_code == 0, res.output
    problems = json.loads(res.stdout)["trusted_key_problems"]
    assert any("junk.pub" in p for p in problems) and any("dir.pub" in p
                                                          and "not a regular file" in p for p in problems)
    assert "junk.pub" in res.stderr
    other = generate_key(tmp_path / "other.key")
    (keys / "two.pub").write_bytes(other.public_path.read_bytes() + node_run["key"].public_path.read_bytes())
    res = runner.invoke(app, ["verify", str(node_run["out"] / "receipts" / "long.receipt"), "--key",
                              str(keys / "two.pub"), "--model", str(node_run["ckpt"])])
    assert res.exit_code == 2 and "holds 2 PEM blocks" in res.stderr


def test_a_run_whose_receipt_is_renumbered_or_its_run_changed_is_seen(node_run, tmp_path) -> None:
    """Coverage is by run and sequence number: two receipts of one run with one number FAIL."""
    a, b = _receipt(node_run, "long"), _receipt(node_run, "sampled")
    folder = tmp_path / "runs"
    _save(node_run, folder, a)
    _save(node_run, folder, dataclasses.replace(b, run=RunRecord(a.run.run_id, a.run.seq)))
    code, report = _verify(node_run, folder)
    cov = [o for o in report["outcomes"] if o["kind"] == "coverage"]
    assert code == 1 and any("sequence number" in o["message"] for o in cov), report
