"""lm-eval with no `tokenizer=` against the server: it finds /tokenizer_info, tokenizes through /tokenize and
/detokenize, and sends the very requests (bound in the receipts) that a local copy of the checkpoint gives."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from eval_helpers import run_lm_eval, serving
from prometheus_client.parser import text_string_to_metric_families

from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.receipt import verify_envelope

TASKS = "detent_qa_mc,detent_qa_gen"
LIMIT = 2


def _requests(paths: list[Path], trusted: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Each receipt's bound request body with its id-free part, and its prompt ids."""
    found = []
    for p in paths:
        r = verify_envelope(read_envelope_bytes(p), trusted).receipt
        found.append((r.request.client.body_json.decode(), tuple(r.request.prompt_token_ids)))
    return sorted(found)


def _scores(out: Path) -> dict:
    (results,) = out.rglob("results_*.json")
    return {task: {k: v for k, v in scores.items() if not k.endswith("_stderr,none")}
            for task, scores in json.loads(results.read_text())["results"].items()}


@pytest.mark.slow
def test_lm_eval_without_a_tokenizer_folder_tokenizes_through_the_server(eval_checkpoint: Path, node_key,
                                                                          tmp_path: Path) -> None:
    with serving(eval_checkpoint, node_key, tmp_path / "node", tmp_path / "jit") as served:
        receipts = served.out / "receipts"
        remote = run_lm_eval(served, tmp_path / "remote", TASKS, limit=LIMIT, remote_tokenizer=True)
        by_remote = sorted(receipts.iterdir())
        families = text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)
        calls = {s.labels.get("route"): s.value for f in families for s in f.samples
                 if s.name == "detent_requests_total" and s.labels.get("status") == "200"}
        assert calls.get("/tokenizer_info", 0) >= 1 and calls.get("/tokenize", 0) >= 1, calls
        local = run_lm_eval(served, tmp_path / "local", TASKS, limit=LIMIT)
        by_local = sorted(set(receipts.iterdir()) - set(by_remote))
        assert by_remote and len(by_local) == len(by_remote)
        assert _requests(by_remote, served.trusted) == _requests(by_local, served.trusted)
    assert _scores(remote) == _scores(local)
