"""lm-eval against the server, end to end: every request has a receipt, verify-eval recomputes the reported
score exactly with full coverage; a tampered or removed receipt, or a logged response that is not the
receipt's, drops coverage and names the sample; served at concurrency 1 and 8 the logged logprobs are
bit-identical in detent mode and not in stock mode."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import struct
from pathlib import Path

import pytest
from eval_helpers import run_lm_eval, serving

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.keys import load_private_key
from detent_audit.manifests.receipt import OutputRecord, Receipt, ScoringRecord, sign_receipt, verify_envelope
from detent_audit.verifier.eval_audit import find_run, read_samples, verify_eval

pytestmark = pytest.mark.slow


def _audit(run: Path, receipts: Path, served, **kw):
    return verify_eval(run, [receipts], served.trusted, model=str(served.checkpoint),
                       include_path=[str(Path(__file__).resolve().parents[2] / "examples" / "eval")], **kw)


def _logged(run: Path) -> dict[str, list[dict]]:
    _, samples = find_run(run)
    return {task: read_samples(p) for task, p in samples.items()}


def test_lm_eval_run_is_recomputed_exactly_from_its_receipts(served_run) -> None:
    served, completions, chat = served_run
    for run, tasks in ((completions, {"detent_qa_mc", "detent_qa_gen"}), (chat, {"detent_qa_gen"})):
        report = _audit(run, served.out / "receipts", served)
        assert report.exit_code == 0, report.to_json()
        assert {s.task for s in report.scores} == tasks
        assert all(s.covered == s.total == 6 and s.recomputed == s.reported for s in report.scores)
        assert all(d.covered for d in report.docs) and len(report.docs) == 6 * len(tasks)
        assert report.receipt_counts["OK"] == (6 * 4 + 6 if len(tasks) == 2 else 6)  # one receipt per request
    # every request lm-eval sent has a receipt: the two runs' receipts are all matched, none left over
    receipts = list((served.out / "receipts").iterdir())
    assert len(receipts) == 6 * 4 + 6 + 6
    assert _audit(completions, served.out / "receipts", served).receipts_unmatched == 6  # the chat run's


def _tamper(path: Path, served, edit) -> None:
    receipt = verify_envelope(read_envelope_bytes(path), served.trusted).receipt
    path.write_bytes(sign_receipt(edit(receipt), load_private_key(served.key.private_path)))


def _flip_prompt_bit(r: Receipt) -> Receipt:
    sc = r.scoring
    raw = bytearray(sc.logprobs_f32le)
    raw[-4] ^= 1  # the last prompt position's lowest mantissa bit: the continuation lm-eval sums
    return dataclasses.replace(r, scoring=ScoringRecord(bytes(raw), sc.top_n, sc.top_ids, sc.top_logprobs_f32le))


def _other_token(r: Receipt) -> Receipt:
    ids = list(r.output.token_ids)
    ids[0] = (ids[0] + 1) % 256
    out = OutputRecord.from_floats(ids, r.output.logprobs, r.output.finish_reason, r.output.text,
                                   r.output.top_logprobs)
    return dataclasses.replace(r, output=out)


def test_tampered_or_missing_receipts_drop_coverage_and_name_the_sample(served_run, tmp_path: Path) -> None:
    served, completions, _ = served_run
    receipts = tmp_path / "receipts"
    shutil.copytree(served.out / "receipts", receipts)
    opened = {p: verify_envelope(read_envelope_bytes(p), served.trusted).receipt for p in receipts.iterdir()}
    scoring = sorted(p for p, r in opened.items() if r.scoring is not None)
    generating = sorted(p for p, r in opened.items() if r.scoring is None and r.request.sampling.stop
                        and len(r.output.token_ids) > 1)
    rng = random.Random(16)
    flipped, removed = rng.choice(scoring), rng.choice(generating)
    changed = rng.choice([p for p in generating if p != removed] or [removed])
    _tamper(flipped, served, _flip_prompt_bit)
    removed.unlink()
    if changed != removed:
        _tamper(changed, served, _other_token)
    report = _audit(completions, receipts, served)
    assert report.exit_code == 1
    bad = {(d.task, d.doc_id): " ".join(d.reasons) for d in report.docs if not d.covered}
    expected_bad = 2 + (changed != removed)
    assert len(bad) == expected_bad, bad
    assert any("no receipt of this request" in why for why in bad.values())
    assert any("did not verify" in why and "prompt token" in why for why in bad.values())
    # the score is still recomputed, from the documents that verified: the mean of their logged metrics
    logged = _logged(completions)
    for s in report.scores:
        name = s.metric.split(",")[0]
        kept = [x[name] for x in logged[s.task] if (s.task, int(x["doc_id"])) not in bad]
        assert s.covered == len(kept) < s.total
        assert s.recomputed == pytest.approx(sum(kept) / len(kept), abs=0)


def test_a_logged_response_that_is_not_the_receipts_is_named(served_run, tmp_path: Path) -> None:
    served, completions, _ = served_run
    run = tmp_path / "run"
    shutil.copytree(completions, run)
    _, samples = find_run(run)
    path = samples["detent_qa_mc"]
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    ll, greedy = first["resps"][0][0]  # lm-eval logs the str() of each value
    bits = struct.unpack("<Q", struct.pack("<d", float(ll)))[0] ^ 1  # the lowest bit of the sum's double
    first["resps"][0][0] = [str(struct.unpack("<d", struct.pack("<Q", bits))[0]), greedy]
    path.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    report = _audit(run, served.out / "receipts", served)
    named = [d for d in report.docs if not d.covered]
    assert report.exit_code == 1 and [(d.task, d.doc_id) for d in named] == [("detent_qa_mc", first["doc_id"])]
    assert "lm-eval logged" in named[0].reasons[0]


def _logprobs(run: Path) -> dict[tuple[int, int], list]:
    return {(int(x["doc_id"]), i): r for x in _logged(run)["detent_qa_mc"] for i, r in enumerate(x["resps"])}


@pytest.mark.parametrize("mode", ["detent", "stock"])
def test_concurrency_1_and_8_give_the_same_logprob_bits_in_detent_mode_only(
        mode: str, eval_checkpoint: Path, node_key, tmp_path: Path) -> None:
    """The multiple-choice task's logged [logprob, is_greedy] per request, served at num_concurrent 1 and 8:
    equal in detent mode; in stock mode some differ, and the test prints where (document, choice, both
    values)."""
    with serving(eval_checkpoint, node_key, tmp_path / "node", tmp_path / "jit", mode=mode) as served:
        one = _logprobs(run_lm_eval(served, tmp_path / "c1", "detent_qa_mc", limit=6, batch_size=1, concurrent=1))
        eight = _logprobs(run_lm_eval(served, tmp_path / "c8", "detent_qa_mc", limit=6, batch_size=1, concurrent=8))
    assert one.keys() == eight.keys() and len(one) == 24
    differ = [f"doc {d} choice {c}: {one[d, c][0]} at concurrency 1, {eight[d, c][0]} at 8"
              for d, c in sorted(one) if json.dumps(one[d, c]) != json.dumps(eight[d, c])]
    print(f"{mode}: {len(differ)} of {len(one)} logged responses differ", *differ, sep="\n  ")
    if mode == "detent":
        assert differ == []
        return
    # Stock on this model at one thread: lm-eval's one-prompt requests of about a dozen tokens each, served at
    # concurrency 8, were measured to give the same logged values as at 1 (benchmarks/RESULTS.md, Evaluation),
    # so `differ` is reported, not asserted. What stock does not do is hold a request's bits when its prefill
    # shares a step: the same prompts lm-eval sent (from the stock receipts), scored alone and then all in one
    # batch, differ in stock mode and not in detent mode.
    prompts = [verify_envelope(read_envelope_bytes(p), served.trusted).receipt.request.prompt_token_ids
               for p in sorted((tmp_path / "node" / "receipts").iterdir())]
    pairs = [(list(p[:-1]), list(p[-1:])) for p in prompts]
    for engine_mode in ("stock", "detent"):
        llm = LLM(EngineConfig(model=str(eval_checkpoint), mode=engine_mode, cache_dir=str(tmp_path / "jit")))
        alone = [llm.rescore_batch([pair])[0].logprobs for pair in pairs]
        together = [r.logprobs for r in llm.rescore_batch(pairs)]
        batched = [i for i in range(len(pairs)) if alone[i] != together[i]]
        print(f"{engine_mode}: {len(batched)} of {len(pairs)} prompts' logprob bits change when batched")
        assert bool(batched) == (engine_mode == "stock"), (engine_mode, batched)


def test_verify_eval_checks_the_facts_against_the_published_deployment(served_run, tmp_path: Path) -> None:
    """`--deployment` as verify takes it: the honest run is covered against it; a receipt re-signed with facts
    that are not the published ones (a max_num_seqs no bit depends on) fails, and its sample's coverage with
    it, while without the published deployment the same receipt verifies and the report says the facts are
    self-asserted."""
    from detent_audit.manifests.encoding import facts_hash
    from detent_audit.verifier.verify import load_deployments

    served, completions, _ = served_run
    published = load_deployments([str(served.out.parent / "deployment.json")])
    report = _audit(completions, served.out / "receipts", served, deployments=published)
    assert report.exit_code == 0 and report.to_json()["facts_self_asserted"] is False, report.to_json()
    receipts = tmp_path / "receipts"
    shutil.copytree(served.out / "receipts", receipts)
    scoring = sorted(p for p in receipts.iterdir()
                     if verify_envelope(read_envelope_bytes(p), served.trusted).receipt.scoring is not None)
    target = random.Random(14).choice(scoring)

    def other_facts(r: Receipt) -> Receipt:
        facts = json.loads(json.dumps(r.deployment_facts, default=dict))
        facts["deployment"]["engine"]["max_num_seqs"] = 1
        return dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts))

    _tamper(target, served, other_facts)
    forged_id = verify_envelope(read_envelope_bytes(target), served.trusted).receipt.request.request_id
    report = _audit(completions, receipts, served, deployments=published)
    bad = [d for d in report.docs if not d.covered]
    assert report.exit_code == 1 and len(bad) == 1, report.to_json()
    assert bad[0].task == "detent_qa_mc" and "not among the 1 published deployment" in " ".join(bad[0].reasons)
    assert forged_id in target.name
    report = _audit(completions, receipts, served)
    assert report.exit_code == 0 and report.to_json()["facts_self_asserted"] is True, report.to_json()
