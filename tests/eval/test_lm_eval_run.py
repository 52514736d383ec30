"""lm-eval against the server on a handful of items, end to end (CI's tier; the bigger runs are in
test_lm_eval_slow.py, stock's side in test_lm_eval_stock.py): both task kinds through /v1/completions, every
request has a receipt and every receipt answers a request; verify-eval recomputes the reported score exactly
with full coverage against the published deployment; a tampered receipt (a logprob bit, a token), a removed
one, a logged response that is not the receipt's, or facts that are not the published ones: the score is
recomputed from what verifies, coverage drops, and the sample is named; served at concurrency 1 and 8 (steps
really shared), the per-sample logprobs are bit-identical in detent mode. One server and one lm-eval (in this
process) for the module."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from eval_helpers import TASKS, Served, generations_of, run_lm_eval, serving

from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.encoding import facts_hash
from detent_audit.manifests.intoto import envelope_from_json
from detent_audit.manifests.keys import load_private_key
from detent_audit.manifests.receipt import (
    ClientRequest,
    OutputRecord,
    Receipt,
    ScoringRecord,
    sign_receipt,
    verify_envelope,
)
from detent_audit.runtime.tokenizer import Tokenizer
from detent_audit.verifier.eval_attestation import write_attestation
from detent_audit.verifier.eval_audit import EvalReport, find_run, read_samples, verify_eval
from detent_audit.verifier.eval_rebuild import TaskNotRebuilt
from detent_audit.verifier.verify import load_deployments

LIMIT = 4               # documents per task of the main run: 4 generations, 16 scored prompts in 4 requests
CONCURRENCY_LIMIT = 2   # documents of the multiple-choice task served one prompt per request at 1 and at 8
MAIN_RECEIPTS = LIMIT + 4 * LIMIT


@dataclass
class Run:
    served: Served
    root: Path
    main: Path                  # lm-eval's output of both tasks (batch size 4, concurrency 1)
    main_receipts: list[Path]   # the receipts the server wrote during it
    hinted: Path                # the generate task run with prompts that state the answer
    hinted_receipts: list[Path]
    c1: Path
    c8: Path
    # concurrency -> the engine's steps during that run, by sequences per step
    steps: dict[int, dict[int, int]]
    # concurrency -> prompt ids -> (tokens, logprob bits)
    generations: dict[int, dict[tuple[int, ...], tuple]]

    @property
    def receipts(self) -> Path:
        return self.served.out / "receipts"

    def main_receipts_copy(self, to: Path, receipts: list[Path] | None = None) -> Path:
        to.mkdir()
        for p in self.main_receipts if receipts is None else receipts:
            shutil.copy2(p, to / p.name)
        return to


def _hinting_tasks(to: Path) -> Path:
    """The shipped tasks, the generate task's prompt stating each document's answer (a node's own copy)."""
    shutil.copytree(TASKS, to)
    yaml = to / "detent_qa_gen.yaml"
    text = yaml.read_text()
    assert "{{question}}\\nAnswer:" in text
    hint = "{{question}} (the answer is {{answer}})\\nAnswer:"
    yaml.write_text(text.replace("{{question}}\\nAnswer:", hint))
    return to


def _steps_between(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {n: after[n] - before.get(n, 0) for n in after if after[n] - before.get(n, 0)}


@pytest.fixture(scope="module")
def run(eval_checkpoint: Path, node_key, tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("eval-run")
    with serving(eval_checkpoint, node_key, root / "node", root / "jit") as served:
        served.node.publish(root / "deployment.json")
        main = run_lm_eval(served, root / "lm-eval", "detent_qa_mc,detent_qa_gen", limit=LIMIT, batch_size=4)
        main_receipts = sorted((served.out / "receipts").iterdir())
        hinted = run_lm_eval(served, root / "hinted", "detent_qa_gen", limit=LIMIT, batch_size=4,
                             task_path=_hinting_tasks(root / "hinting-tasks"))
        hinted_receipts = sorted(set((served.out / "receipts").iterdir()) - set(main_receipts))
        steps, outs, generations = {}, {}, {}
        for c in (1, 8):
            before, names = served.steps(), set((served.out / "receipts").iterdir())
            outs[c] = run_lm_eval(served, root / f"c{c}", "detent_qa_mc,detent_qa_gen",
                                  limit=CONCURRENCY_LIMIT, batch_size=1, concurrent=c)
            steps[c] = _steps_between(before, served.steps())
            generations[c] = generations_of(set((served.out / "receipts").iterdir()) - names, served.trusted)
    return Run(served, root, main, main_receipts, hinted, hinted_receipts, outs[1], outs[8], steps,
               generations)


def _audit(run_dir: Path, receipts: Path, served: Served, **kw) -> EvalReport:
    return verify_eval(run_dir, [receipts], served.trusted, model=str(served.checkpoint),
                       include_path=[str(TASKS)], cache_dir=str(served.out.parent / "jit"), **kw)


def _logged(run_dir: Path) -> dict[str, list[dict]]:
    _, samples = find_run(run_dir)
    return {task: read_samples(p) for task, p in samples.items()}


def _open(path: Path, served: Served) -> Receipt:
    return verify_envelope(read_envelope_bytes(path), served.trusted).receipt


def _resign(path: Path, served: Served, edit) -> None:
    path.write_bytes(sign_receipt(edit(_open(path, served)), load_private_key(served.key.private_path)))


def test_every_request_has_a_receipt_and_the_score_is_recomputed_exactly(run: Run, tmp_path: Path) -> None:
    served = run.served
    assert len(run.main_receipts) == MAIN_RECEIPTS  # one per prompt: 4 per multiple-choice request
    published = load_deployments([str(run.root / "deployment.json")])
    report = _audit(run.main, run.main_receipts_copy(tmp_path / "receipts"), served, deployments=published)
    got = report.to_json()
    assert report.exit_code == 0, got
    assert {s.task for s in report.scores} == {"detent_qa_mc", "detent_qa_gen"}
    assert {s.metric.split(",")[0] for s in report.scores} == {"acc", "acc_norm", "exact_match"}
    for s in report.scores:
        assert s.covered == s.total == LIMIT and s.recomputed is not None
        assert json.dumps(s.recomputed) == json.dumps(s.reported), s  # bit for bit, not approximately
    assert len(report.docs) == 2 * LIMIT and all(d.covered for d in report.docs)
    # every request lm-eval sent has a receipt, and every receipt of the run answers one of them
    assert report.receipt_counts["OK"] == MAIN_RECEIPTS and report.receipts_unmatched == 0
    assert got["facts_self_asserted"] is False
    # the run is the --limit prefix of the task's documents (every line of its data file is one)
    task_documents = len((TASKS / "qa.jsonl").read_text().splitlines())
    assert got["documents"] == {t: {"run": LIMIT, "task": task_documents, "limit": LIMIT}
                                for t in ("detent_qa_mc", "detent_qa_gen")}
    # the task really ran both request kinds: echo scoring, and generations cut at a stop string
    opened = [_open(p, served) for p in run.main_receipts]
    assert sum(r.scoring is not None for r in opened) == 4 * LIMIT
    generations = [r for r in opened if r.scoring is None]
    # lm-eval may add its EOS
    assert all({"\n", "Question:"} <= set(r.request.sampling.stop) for r in generations)
    assert any(r.output.finish_reason == "stop" for r in generations), [r.output.text for r in generations]
    # the audit as an in-toto test-result attestation signed by the verifier's key: PASSED, each receipt named
    verifier_key = Ed25519PrivateKey.generate()
    write_attestation(report, tmp_path / "attestation.json", verifier_key)
    outer = envelope_from_json(json.loads((tmp_path / "attestation.json").read_text()), "attestation")
    outer.verify({"verifier": verifier_key.public_key()})
    predicate = json.loads(outer.payload)["predicate"]
    assert predicate["result"] == "PASSED" and predicate["failedTests"] == []
    assert len(predicate["passedTests"]) == len(report.scores)
    assert sorted(r["digest"]["sha256"] for r in predicate["receipts"]) == sorted(r.digest for r in opened)


def _flip_prompt_bit(r: Receipt) -> Receipt:
    sc = r.scoring
    raw = bytearray(sc.logprobs_f32le)
    raw[-4] ^= 1  # the last prompt position's lowest mantissa bit: the continuation lm-eval sums
    return dataclasses.replace(r,
                               scoring=ScoringRecord(bytes(raw), sc.top_n, sc.top_ids, sc.top_logprobs_f32le))


def _other_first_token(r: Receipt) -> Receipt:
    ids = list(r.output.token_ids)
    ids[0] = (ids[0] + 1) % 256
    return dataclasses.replace(r,
                               output=OutputRecord.from_floats(ids, r.output.logprobs, r.output.finish_reason,
                                                                  r.output.text, r.output.top_logprobs))


def _question(r: Receipt, tokenizer: Tokenizer) -> str:
    """The document's own question in a request's prompt (after the few-shot examples, if any)."""
    return tokenizer.decode(list(r.request.prompt_token_ids)).rsplit("Question: ", 1)[1].split("\n", 1)[0]


def _other_facts(r: Receipt) -> Receipt:
    """Facts that are not the published ones: a max_num_seqs no bit depends on."""
    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    facts["deployment"]["engine"]["max_num_seqs"] = 1
    return dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts))


def _flip_logged_sum(path: Path, doc_id: int) -> None:
    """The lowest bit of the double lm-eval logged as a document's first log-likelihood (it logs the
    str())."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        sample = json.loads(line)
        if int(sample["doc_id"]) == doc_id:
            ll, greedy = sample["resps"][0][0]
            bits = struct.unpack("<Q", struct.pack("<d", float(ll)))[0] ^ 1
            sample["resps"][0][0] = [str(struct.unpack("<d", struct.pack("<Q", bits))[0]), greedy]
            lines[i] = json.dumps(sample)
    path.write_text("\n".join(lines) + "\n")


def test_tampered_removed_or_misreported_requests_drop_coverage_and_name_the_sample(
        run: Run, tmp_path: Path) -> None:
    """Each in a document of its own, chosen afresh: a scored prompt's logprob bit flipped, a generation's
    token changed (both re-signed: only re-execution finds them), a generation's receipt removed, a scoring
    receipt re-signed with facts that are not the published ones, and one log-likelihood lm-eval logged
    changed. The audit against the published deployment names exactly those five documents, each with its
    reason, and recomputes every score from the documents that verified; without the published deployment the
    re-signed facts are self-asserted, so that document is covered again and the report says so."""
    served = run.served
    receipts = run.main_receipts_copy(tmp_path / "receipts")
    shutil.copytree(run.main, tmp_path / "run")
    tokenizer = Tokenizer.from_pretrained(served.checkpoint)
    docs = {t: {x["doc"]["question"]: int(x["doc_id"]) for x in xs} for t, xs in _logged(run.main).items()}
    by_doc: dict[tuple[str, int], list[Path]] = {}
    for p in sorted(receipts.iterdir()):
        r = _open(p, served)
        task = "detent_qa_mc" if r.scoring is not None else "detent_qa_gen"
        by_doc.setdefault((task, docs[task][_question(r, tokenizer)]), []).append(p)
    rng = random.Random()  # fresh choices each run: any document must do
    mc = rng.sample(sorted(k for k in by_doc if k[0] == "detent_qa_mc"), 3)
    gen = rng.sample(sorted(k for k in by_doc if k[0] == "detent_qa_gen"), 2)
    _resign(rng.choice(by_doc[mc[0]]), served, _flip_prompt_bit)
    _resign(rng.choice(by_doc[mc[1]]), served, _other_facts)
    _flip_logged_sum(find_run(tmp_path / "run")[1]["detent_qa_mc"], mc[2][1])
    _resign(by_doc[gen[0]][0], served, _other_first_token)
    by_doc[gen[1]][0].unlink()
    expected = {mc[0]: ["did not verify", "prompt token"], mc[1]: ["not among the 1 published deployment"],
                mc[2]: ["lm-eval logged"], gen[0]: ["did not verify"],
                gen[1]: ["no receipt binds the body lm-eval sent"]}
    logged = _logged(run.main)
    published = load_deployments([str(run.root / "deployment.json")])
    for deployments, named_now in ((published, expected),
                                   (None, {k: v for k, v in expected.items() if k != mc[1]})):
        report = _audit(tmp_path / "run", receipts, served, deployments=deployments)
        assert report.exit_code == 1
        named = {(d.task, d.doc_id): " ".join(d.reasons) for d in report.docs if not d.covered}
        assert named.keys() == named_now.keys(), (named, named_now)
        for sample, whys in named_now.items():
            assert all(why in named[sample] for why in whys), (sample, named[sample])
        assert report.to_json()["facts_self_asserted"] is (deployments is None)
        assert report.to_json()["coverage"]["covered"] == 2 * LIMIT - len(named_now)
        # the score is still recomputed, from the documents that verified: the mean of their logged metrics
        for s in report.scores:
            kept = [x[s.metric.split(",")[0]]
                    for x in logged[s.task] if (s.task, int(x["doc_id"])) not in named]
            assert s.covered == len(kept) < s.total == LIMIT
            assert s.recomputed == sum(kept) / len(kept)


def _responses(run_dir: Path) -> dict[tuple[int, int], str]:
    """Per (document, choice) the logged [logprob, is_greedy], as lm-eval wrote it (the str() of the sum)."""
    return {(int(x["doc_id"]), i): json.dumps(r) for x in _logged(run_dir)["detent_qa_mc"]
            for i, r in enumerate(x["resps"])}


def test_concurrency_1_and_8_give_bit_identical_logprobs_in_detent_mode(run: Run) -> None:
    """The multiple-choice task's logged [logprob, is_greedy] per request, and the generate task's output
    tokens and logprob bits per sample (from its receipts: lm-eval logs only the text), equal at 1 and 8."""
    one, eight = _responses(run.c1), _responses(run.c8)
    assert one.keys() == eight.keys() and len(one) == 4 * CONCURRENCY_LIMIT
    assert max(run.steps[1]) == 1, run.steps  # one request at a time: every step ran one sequence
    assert max(run.steps[8]) > 1, run.steps   # at 8, requests really shared steps
    differ = [k for k in one if one[k] != eight[k]]
    assert differ == [], [(k, one[k], eight[k]) for k in differ]
    assert run.generations[1].keys() == run.generations[8].keys()
    assert len(run.generations[1]) == CONCURRENCY_LIMIT
    assert run.generations[1] == run.generations[8]


# ---- runs whose documents, tasks or bodies are not the task's, their bookkeeping kept consistent


def _keep_bookkeeping(run_dir: Path) -> None:
    """What a forger who edited the samples files recomputes so that lm-eval's own records agree with them:
    each sample's metrics (the task's `process_results` on the logged responses and document), its
    `doc_hash`, `prompt_hash` and `target_hash`, and per task the reported scores, `n-samples` and
    `task_hashes`: the run reads as lm-eval would have written it for these samples."""
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, hash_string

    results_path, paths = find_run(run_dir)
    results = json.loads(results_path.read_text())
    names = sorted(t for t in paths if t in results["configs"])
    task_objs = TaskManager(include_path=str(TASKS), include_defaults=False).load(names)["tasks"]
    for task in names:
        path = paths[task]
        obj, rows = task_objs[task], [json.loads(line) for line in path.read_text().splitlines()]
        values: dict[str, list] = {}
        for row in rows:
            resps = row["filtered_resps"]  # lm-eval logs a log-likelihood's values as str()
            if obj.OUTPUT_TYPE == "multiple_choice":
                resps = [(float(ll), greedy == "True") for ll, greedy in resps]
            for metric, value in obj.process_results(row["doc"], resps).items():
                row[metric] = value
                values.setdefault(f"{metric},{row['filter']}", []).append(value)
            row["doc_hash"] = hash_string(json.dumps(row["doc"], indent=2, default=handle_non_serializable,
                                                     ensure_ascii=False))
            row["prompt_hash"] = hash_string(row["arguments"]["gen_args_0"]["arg_0"])
            row["target_hash"] = hash_string(row["target"])
        aggregation = obj.aggregation()
        for key, vals in values.items():
            results["results"][task][key] = aggregation[key.split(",")[0]](vals)
        results["n-samples"][task]["effective"] = len({row["doc_id"] for row in rows})
        results["task_hashes"][task] = hash_string("".join(r["doc_hash"] + r["prompt_hash"] + r["target_hash"]
                                                           for r in rows))
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    results_path.write_text(json.dumps(results, indent=2))


def _edit_samples(run_dir: Path, task: str, edit) -> None:
    path = find_run(run_dir)[1][task]
    rows = edit([json.loads(line) for line in path.read_text().splitlines()])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@dataclass
class Forged:
    report: EvalReport
    relabelled: int             # the multiple-choice document whose gold answer the node changed
    dropped: int                # the multiple-choice document left out of the samples
    swapped: tuple[int, int]    # the generate task's documents whose doc_ids were exchanged
    other_body: int             # the generate document whose receipt binds a body lm-eval never sent


def _a_body_lm_eval_never_sent(path: Path, served: Served) -> None:
    """The receipt re-signed for the same prompt and sampling, bound to a body of that prompt alone (lm-eval
    sent it in a batch of several), under a fresh request id (its file named after it)."""
    r = _open(path, served)
    body = r.request.client.body()
    position = int(r.request.request_id.rsplit("-", 1)[1])
    body["prompt"] = body["prompt"][position]
    rid = f"cmpl-{uuid.uuid4().hex}"
    client = ClientRequest.of(r.request.client.api, body)
    request = dataclasses.replace(r.request, request_id=rid, client=client)
    signed = sign_receipt(dataclasses.replace(r, request=request), load_private_key(served.key.private_path))
    path.unlink()
    (path.parent / f"{rid}.receipt").write_bytes(signed)


@pytest.fixture(scope="module")
def forged(run: Run, tmp_path_factory: pytest.TempPathFactory) -> Forged:
    """One run forged five ways, each in documents of its own, lm-eval's bookkeeping kept consistent, audited
    once against the published deployment: a relabelled gold answer, a document left out (a cherry-picked
    subset), two documents' ids exchanged, a reported task never logged and a logged task never reported,
    and a generation's receipt bound to a body lm-eval never sent."""
    root = tmp_path_factory.mktemp("forged")
    served = run.served
    shutil.copytree(run.main, root / "run")
    receipts = run.main_receipts_copy(root / "receipts")
    rng = random.Random()
    logged = _logged(run.main)
    mc = rng.sample(sorted(int(x["doc_id"]) for x in logged["detent_qa_mc"]), 2)
    gen = rng.sample(sorted(int(x["doc_id"]) for x in logged["detent_qa_gen"]), 3)

    def relabel_and_drop(rows: list[dict]) -> list[dict]:
        for row in rows:
            if row["doc_id"] == mc[0]:  # the gold answer made the choice the model liked best, or another
                lls = [float(r[0][0]) for r in row["resps"]]
                best = max(range(len(lls)), key=lls.__getitem__)
                label = best if best != row["doc"]["label"] else (best + 1) % len(lls)
                row["doc"]["label"], row["target"] = label, str(label)
        return [row for row in rows if row["doc_id"] != mc[1]]

    def swap(rows: list[dict]) -> list[dict]:
        ids = {gen[0]: gen[1], gen[1]: gen[0]}
        for row in rows:
            row["doc_id"] = ids.get(row["doc_id"], row["doc_id"])
        return sorted(rows, key=lambda row: row["doc_id"])

    _edit_samples(root / "run", "detent_qa_mc", relabel_and_drop)
    _edit_samples(root / "run", "detent_qa_gen", swap)
    results_path, paths = find_run(root / "run")
    shutil.copy2(paths["detent_qa_gen"], paths["detent_qa_gen"].with_name(
        paths["detent_qa_gen"].name.replace("detent_qa_gen", "detent_qa_gen_unlisted")))
    results = json.loads(results_path.read_text())
    results["results"]["detent_qa_unlogged"] = {"alias": "detent_qa_unlogged", "acc,none": 1.0}
    results_path.write_text(json.dumps(results, indent=2))
    _keep_bookkeeping(root / "run")
    tokenizer = Tokenizer.from_pretrained(served.checkpoint)
    questions = {x["doc"]["question"]: int(x["doc_id"]) for x in logged["detent_qa_gen"]}
    for p in sorted(receipts.iterdir()):
        r = _open(p, served)
        if r.scoring is None and questions[_question(r, tokenizer)] == gen[2]:
            _a_body_lm_eval_never_sent(p, served)
    published = load_deployments([str(run.root / "deployment.json")])
    report = _audit(root / "run", receipts, served, deployments=published)
    return Forged(report, mc[0], mc[1], (gen[0], gen[1]), gen[2])


def _reasons(report: EvalReport, task: str, doc_id: int) -> str:
    (doc,) = [d for d in report.docs if (d.task, d.doc_id) == (task, doc_id)]
    assert not doc.covered
    return " ".join(doc.reasons)


def test_a_relabelled_gold_answer_is_named_and_the_score_uses_the_tasks_own(forged: Forged, run: Run) -> None:
    report = forged.report
    assert report.exit_code == 1
    why = _reasons(report, "detent_qa_mc", forged.relabelled)
    assert "the logged document is not the task's document" in why and "target_hash" in why, why
    # the score is recomputed from the task's own documents: the genuine run's metrics of the covered ones
    genuine = {int(x["doc_id"]): x for x in _logged(run.main)["detent_qa_mc"]}
    covered = [d.doc_id for d in report.docs if d.task == "detent_qa_mc" and d.covered]
    assert sorted(covered) == sorted(set(genuine) - {forged.relabelled, forged.dropped})
    for s in report.scores:
        if s.task == "detent_qa_mc":
            kept = [genuine[i][s.metric.split(",")[0]] for i in sorted(covered)]
            assert (s.covered, s.total, s.recomputed) == (len(kept), LIMIT, sum(kept) / len(kept))


def test_a_cherry_picked_subset_is_named(forged: Forged) -> None:
    report = forged.report
    assert report.exit_code == 1
    assert "logged no sample of this document" in _reasons(report, "detent_qa_mc", forged.dropped)
    assert any(f"reports 3 documents, the task's run has {LIMIT}" in p for p in report.problems), \
        report.problems
    assert report.to_json()["coverage"]["total"] == 2 * LIMIT  # the task's documents, not the logged ones


def test_renumbered_documents_are_named(forged: Forged) -> None:
    for doc_id in forged.swapped:
        why = _reasons(forged.report, "detent_qa_gen", doc_id)
        assert "the logged document is not the task's document" in why, why


def test_a_task_reported_or_logged_alone_is_named(forged: Forged) -> None:
    problems = forged.report.problems
    assert any("task detent_qa_unlogged is reported, and its samples were not logged" in p for p in problems)
    assert any("samples file of task detent_qa_gen_unlisted, which the results do not list" in p
               for p in problems)
    assert forged.report.exit_code == 1


def test_a_receipt_of_a_body_lm_eval_never_sent_covers_nothing(forged: Forged) -> None:
    """Its prompt and sampling are the request's, and it verifies; but lm-eval sent that prompt in a batch."""
    why = _reasons(forged.report, "detent_qa_gen", forged.other_body)
    assert why == "request 0: no receipt binds the body lm-eval sent for it", why
    assert forged.report.receipts_unmatched == 1


def test_answer_hinting_prompts_are_named(run: Run, tmp_path: Path) -> None:
    """The generate task served with prompts that state the answer, the run's task config rewritten to the
    shipped one: every document is named (its prompt is not the task's, and no receipt binds the body
    lm-eval sends for the task's prompt)."""
    shutil.copytree(run.hinted, tmp_path / "run")
    results_path, _ = find_run(tmp_path / "run")
    results = json.loads(results_path.read_text())
    results["configs"] = json.loads(find_run(run.main)[0].read_text())["configs"]
    results_path.write_text(json.dumps(results, indent=2))
    published = load_deployments([str(run.root / "deployment.json")])
    receipts = run.main_receipts_copy(tmp_path / "receipts", run.hinted_receipts)
    report = _audit(tmp_path / "run", receipts, run.served, deployments=published)
    assert report.exit_code == 1
    assert [d.doc_id for d in report.docs if not d.covered] == list(range(LIMIT))
    for d in report.docs:
        why = " ".join(d.reasons)
        assert "prompt_hash" in why and "no receipt binds the body lm-eval sent" in why, why
    assert report.receipts_unmatched == len(run.hinted_receipts) == LIMIT
    assert all(s.covered == 0 and s.recomputed is None for s in report.scores)


def test_a_task_whose_data_cannot_be_loaded_is_not_comparable(run: Run, tmp_path: Path) -> None:
    shutil.copytree(TASKS, tmp_path / "tasks")
    (tmp_path / "tasks" / "qa.jsonl").unlink()
    with pytest.raises(TaskNotRebuilt) as caught:
        verify_eval(run.main, [run.receipts], run.served.trusted, model=str(run.served.checkpoint),
                    include_path=[str(tmp_path / "tasks")])
    assert caught.value.exit_code == 3 and "cannot be loaded here" in caught.value.message
    assert "never uses the samples file's copy" in caught.value.remedy
