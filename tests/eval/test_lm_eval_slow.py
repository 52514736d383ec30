"""The bigger lm-eval runs (marked slow; CI's tier is test_lm_eval_run.py): the generate task through
/v1/chat/completions with lm-eval's chat template recomputed exactly from its receipts, and concurrency 1
against 8 through a server of each mode at two engine threads, where the BLAS splits a product's rows between
threads by the number of rows: detent's logged logprobs are bit-identical, stock's are reported where they
differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_helpers import TASKS, run_lm_eval, serving

from detent_audit.verifier.eval_audit import find_run, read_samples, verify_eval

pytestmark = pytest.mark.slow


def test_a_chat_completions_run_is_recomputed_exactly_from_its_receipts(eval_checkpoint: Path, node_key,
                                                                        tmp_path: Path) -> None:
    with serving(eval_checkpoint, node_key, tmp_path / "node", tmp_path / "jit") as served:
        chat = run_lm_eval(served, tmp_path / "lm-eval-chat", "detent_qa_gen", chat=True, limit=6,
                           batch_size=1)
    report = verify_eval(chat, [served.out / "receipts"], served.trusted, model=str(served.checkpoint),
                         include_path=[str(TASKS)])
    assert report.exit_code == 0, report.to_json()
    assert [(s.task, s.covered, s.total) for s in report.scores] == [("detent_qa_gen", 6, 6)]
    assert all(json.dumps(s.recomputed) == json.dumps(s.reported) for s in report.scores)
    assert report.receipt_counts["OK"] == 6 and report.receipts_unmatched == 0


def _responses(run: Path) -> dict[tuple[int, int], str]:
    _, samples = find_run(run)
    return {(int(x["doc_id"]), i): json.dumps(r) for x in read_samples(samples["detent_qa_mc"])
            for i, r in enumerate(x["resps"])}


@pytest.mark.parametrize("mode", ["detent", "stock"])
def test_concurrency_1_and_8_at_two_threads(mode: str, eval_checkpoint: Path, node_key,
                                            tmp_path: Path) -> None:
    """The multiple-choice task's logged [logprob, is_greedy] per request, served at num_concurrent 1 and 8
    (one prompt per request), at two engine threads: equal in detent mode; in stock mode the test prints
    where they differ (document, choice, both values) and requires that steps were shared at 8."""
    with serving(eval_checkpoint, node_key, tmp_path / "node", tmp_path / "jit", mode=mode,
                 threads=2) as served:
        one = _responses(run_lm_eval(served, tmp_path / "c1", "detent_qa_mc", limit=8, batch_size=1,
                                     concurrent=1))
        before = served.steps()
        eight = _responses(run_lm_eval(served, tmp_path / "c8", "detent_qa_mc", limit=8, batch_size=1,
                                       concurrent=8))
        shared = {n: c - before.get(n, 0) for n, c in served.steps().items() if n > 1
                  and c > before.get(n, 0)}
    assert one.keys() == eight.keys() and len(one) == 32
    assert shared, "no step ran two sequences together at concurrency 8"
    differ = [f"doc {d} choice {c}: {one[d, c]} at concurrency 1, {eight[d, c]} at 8"
              for d, c in sorted(one) if one[d, c] != eight[d, c]]
    print(f"{mode}: {len(differ)} of {len(one)} logged responses differ; steps shared at 8: {shared}",
          *differ, sep="\n  ")
    if mode == "detent":
        assert differ == []


def test_the_multiple_choice_task_on_the_vllm_engine_is_recomputed_by_verify_eval(eval_checkpoint: Path,
                                                                                   node_key,
                                                                                   tmp_path: Path) -> None:
    """lm-eval's loglikelihood requests (echo, prompt logprobs) against the vLLM engine behind the server:
    each answered with a receipt binding its prompt scores, and verify-eval rebuilds vLLM from the receipts,
    re-executes them and recomputes the task's score from them."""
    pytest.importorskip("vllm")
    with serving(eval_checkpoint, node_key, tmp_path / "node", tmp_path / "jit", engine="vllm") as served:
        run = run_lm_eval(served, tmp_path / "lm-eval-mc", "detent_qa_mc", limit=4, batch_size=1)
    report = verify_eval(run, [served.out / "receipts"], served.trusted, model=str(served.checkpoint),
                         include_path=[str(TASKS)])
    assert report.exit_code == 0, report.to_json()
    assert {(s.task, s.covered, s.total) for s in report.scores} == {("detent_qa_mc", 4, 4)}  # acc, acc_norm
    assert all(json.dumps(s.recomputed) == json.dumps(s.reported) for s in report.scores)
    assert report.receipt_counts["OK"] == 16 and report.receipts_unmatched == 0
