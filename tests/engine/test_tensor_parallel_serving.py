"""Serve at TP=3 (SmolLM2: 9 heads, 3 KV heads; ranks as gloo processes), verify at TP=3 and at TP=1 by rank
emulation; forgeries of the bits and of the TP fact fail where they should; a rank killed mid-stream leaves
no process and no half-written receipt."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.encoding import facts_hash, tuple_hash
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
from detent_audit.manifests.receipt import OutputRecord, sign_receipt, verify_envelope
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import serve_offline
from detent_audit.verifier.verify import verify

MODEL = "smollm2-135m-instruct"
PREFIX = "You are a careful assistant. Answer in one short sentence, then stop. "


def _requests(stop_id: int) -> list[dict[str, Any]]:
    """32 mixed requests: greedy and seeded sampling, chats, stop strings and stop ids, shared prefixes."""
    lines = []
    for i in range(32):
        line: dict[str, Any] = {"id": f"q{i}", "max_tokens": 5 + i % 4}
        if i % 4 == 3:
            line["messages"] = [{"role": "user", "content": f"What is {i} + {i}?"}]
        else:  # every other prompt shares a prefix of several KV pages: prefix-cache hits
            line["prompt"] = (PREFIX if i % 2 == 0 else "") + f"Question {i}: name a colour."
        if i % 3 == 1:
            line.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        elif i % 3 == 2:
            line.update(temperature=1.0, top_k=40, seed=2000 + i)
        if i % 5 == 0:
            line["stop_token_ids"] = [stop_id]
        if i % 7 == 1:
            line["stop"] = [" the"]
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp3")
    llm = LLM(EngineConfig(model=MODEL, tensor_parallel_size=3, max_num_seqs=16))
    try:
        lines = _requests(llm.tokenizer.encode(".", add_special_tokens=False)[0])
        (tmp / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
        key = generate_key(tmp / "node.key")
        node = ServingNode(llm, load_private_key(key.private_path), tmp / "out")
        assert serve_offline(llm, node, tmp / "in.jsonl", tmp / "out.jsonl") == 32
        node.close()
        assert max(llm.step_batch_sizes) > 1  # requests shared steps
    finally:
        llm.shutdown()
    return {"out": tmp / "out", "key": key}


def test_tp3_receipts_verify_at_tp1_by_rank_emulation(served: dict[str, Any]) -> None:
    report = verify([served["out"]], load_trusted_keys(served["key"].public_path))
    assert report.counts()["OK"] == 33 and report.exit_code == 0, [o.message for o in report.outcomes]
    receipts = [o for o in report.outcomes if o.kind == "receipt"]
    assert all("TP=3 by rank emulation" in o.message for o in receipts)


@pytest.mark.slow
def test_tp3_receipts_verify_natively_at_tp3(served: dict[str, Any]) -> None:
    report = verify([served["out"]], load_trusted_keys(served["key"].public_path), tensor_parallel=3)
    assert report.counts()["OK"] == 33 and report.exit_code == 0, [o.message for o in report.outcomes]


def _forged(served: dict[str, Any], folder: Path, *, flip: int | None = None, facts_edit: Any = None,
            resign: bool = True) -> Path:
    src = served["out"] / "receipts" / "q4.receipt"
    data = src.read_bytes()
    r = verify_envelope(data, load_trusted_keys(served["key"].public_path)).receipt
    if flip is not None:
        lps = list(r.output.logprobs)
        bits = struct.unpack("<I", struct.pack("<f", lps[flip]))[0] ^ 1
        lps[flip] = struct.unpack("<f", struct.pack("<I", bits))[0]
        r = dataclasses.replace(r, output=OutputRecord.from_floats(list(r.output.token_ids), lps,
                                                                   r.output.finish_reason, r.output.text))
    if facts_edit is not None:
        facts = json.loads(json.dumps(r.deployment_facts, default=dict))
        tuple_values = json.loads(json.dumps(r.tuple_values, default=dict))
        facts_edit(facts, tuple_values)
        r = dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts),
                                tuple_values=tuple_values, tuple_hash=tuple_hash(tuple_values))
    folder.mkdir()
    path = folder / "q4.receipt"
    if resign:
        path.write_bytes(sign_receipt(r, load_private_key(served["key"].private_path)))
    else:  # the TP fact rewritten inside the signed payload: the envelope's signature no longer holds
        path.write_bytes(data.replace(b'"tensor_parallel_size":3', b'"tensor_parallel_size":1')
                         if b'"tensor_parallel_size":3' in data else _rewrite_msgpack_tp(data))
    return path


def _rewrite_msgpack_tp(data: bytes) -> bytes:
    marker = b"tensor_parallel_size\x03"
    assert marker in data
    return data.replace(marker, b"tensor_parallel_size\x01")


def test_a_flipped_logprob_bit_fails_at_its_position(served: dict[str, Any], tmp_path: Path) -> None:
    path = _forged(served, tmp_path / "flip", flip=2)
    report = verify([path], load_trusted_keys(served["key"].public_path))
    (outcome,) = report.outcomes
    assert outcome.status == "FAIL" and report.exit_code == 1
    assert outcome.divergence is not None and outcome.divergence.position == 2, outcome


def test_a_rewritten_tp_fact_is_refused_by_the_signature(served: dict[str, Any], tmp_path: Path) -> None:
    path = _forged(served, tmp_path / "rewritten", resign=False)
    report = verify([path], load_trusted_keys(served["key"].public_path))
    (outcome,) = report.outcomes
    assert outcome.status != "OK" and "signature" in outcome.message.lower(), outcome


def test_a_receipt_signed_with_a_wrong_tp_fact_fails_at_re_execution(served: dict[str, Any], tmp_path: Path
                                                                     ) -> None:
    """A node that signs TP=1 facts for a TP=3 answer: rebuilt at TP=1, the bits differ: FAIL, not OK."""
    def claim_tp1(facts: dict[str, Any], tuple_values: dict[str, Any]) -> None:
        del facts["parallel"]
        facts["deployment"]["parallel"]["tensor_parallel_size"] = 1
        del tuple_values["embedded.all_reduce"]  # a consistent lie: TP=1 has no all-reduce to pin
        del facts["tuple"]["embedded.all_reduce"]

    path = _forged(served, tmp_path / "tp1", facts_edit=claim_tp1)
    report = verify([path], load_trusted_keys(served["key"].public_path))
    (outcome,) = report.outcomes
    assert outcome.status == "FAIL" and report.exit_code == 1, outcome
