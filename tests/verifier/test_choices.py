"""`n` choices per request, through the `openai` client against the real server: each choice sampled with its
own seed (the client's seed + i, or derived from the run and the body with the choice index) and signed in its
own receipt, which `verify` and `verify-response` accept; a receipt that claims another choice's seed
FAILs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import openai
import pytest
from threaded_server import threaded_server

from detent_audit.manifests.keys import load_trusted_keys
from detent_audit.manifests.receipt import ClientRequest, Receipt, verify_envelope
from detent_audit.manifests.seeds import choice_seed, derived_seed
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.verifier.client import verify_response
from detent_audit.verifier.response_view import CHAT, COMPLETIONS
from detent_audit.verifier.verify import verify

MODEL = "tiny-llama"


def _chunks(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


@pytest.fixture(scope="module")
def node(new_node):
    n = new_node("choices")
    n.node.publish(n.root / "deployment.json")
    return n


def _receipt(path: Path, trusted: dict) -> Receipt:
    return verify_envelope(path.read_bytes(), trusted).receipt


def test_n_choices_each_have_their_own_seed_and_receipt_and_verify(node, tmp_path: Path) -> None:
    trusted = load_trusted_keys(node.key.public_path)
    seed = int.from_bytes(os.urandom(7), "little")
    prompt = [int(t) for t in os.urandom(6)]
    bodies = {
        "seeded": (COMPLETIONS, {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
                                 "seed": seed, "n": 4, "best_of": 4, "ignore_eos": True, "logprobs": 1}),
        "unseeded-chat": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Name a city."}],
                                 "max_tokens": 6, "temperature": 1.0, "n": 3}),
        "batch": (COMPLETIONS, {"model": MODEL, "prompt": ["One", "Two"], "max_tokens": 4, "temperature": 1.0,
                                "seed": seed, "n": 2, "ignore_eos": True}),
        "stream": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                          "temperature": 1.0, "seed": seed, "n": 2, "stream": True,
                          "stream_options": {"include_usage": True}}),
    }
    with threaded_server(create_app(AsyncEngine(node.llm), node.node, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        sdk = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=seed,
                                        n=4, extra_body={"ignore_eos": True})
        got: dict[str, tuple[str, dict, object, list[str]]] = {}
        with httpx.Client(base_url=url, timeout=300) as http:
            for name, (endpoint, body) in bodies.items():
                r = http.post(endpoint, json=body)
                assert r.status_code == 200, r.text
                response = _chunks(r.text) if body.get("stream") else r.json()
                ids = r.headers["X-Detent-Receipt"].split(",")
                got[name] = (endpoint, body, response, ids)
            refused = http.post(COMPLETIONS, json={"prompt": "x", "n": 2, "best_of": 3})
        # the node answers choice 1 of a seeded n = 2 request with choice 0's seed (both choices alike)
        lazy = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": seed, "n": 2}
        params = SamplingParams(temperature=1.0, max_tokens=4, seed=seed)
        node.node.sign(node.llm.generate([prompt], params)[0], params, "cmpl-lazy-1",
                       ClientRequest.of("openai/v1/completions", lazy))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of", refused.text

    # the SDK: 4 distinct samples, each naming its receipt; choice i sampled with seed + i
    texts = [c.text for c in sdk.choices]
    assert [c.index for c in sdk.choices] == [0, 1, 2, 3] and len(set(texts)) == 4, texts
    receipts = [_receipt(node.node.receipt_path(c.receipt_id), trusted) for c in sdk.choices]  # type: ignore
    assert [r.request.seed for r in receipts] == [choice_seed(seed, i) for i in range(4)]
    assert [r.output.text for r in receipts] == texts
    assert [r.request.request_id for r in receipts] == [f"{sdk.id}-{i}" for i in range(4)]

    _, body, _, ids = got["unseeded-chat"]
    client_request = ClientRequest.of("openai/v1/chat/completions", body)
    chat = [_receipt(node.node.receipt_path(i), trusted) for i in ids]
    assert [r.request.seed for r in chat] == [derived_seed(node.node.run_id, client_request.api,
                                                           client_request.body_sha256, i) for i in range(3)]
    _, _, _, ids = got["batch"]  # choice i answers prompt i // n, with seed + i % n
    batch = [_receipt(node.node.receipt_path(i), trusted) for i in ids]
    assert [r.request.seed for r in batch] == [seed, seed + 1, seed, seed + 1]
    prompts = [r.request.prompt_token_ids for r in batch]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    _, _, stream, ids = got["stream"]
    indexes = {c["index"] for chunk in stream for c in chunk["choices"]}  # type: ignore[attr-defined]
    assert len(ids) == 2 and indexes == {0, 1}

    report = verify([node.root / "out"], trusted, model=str(node.ckpt), cache_dir=str(node.root / "jit"))
    verdicts = {o.request_id: o.status for o in report.outcomes if o.kind == "receipt"}
    lazy_verdict = [o for o in report.outcomes if o.request_id == "cmpl-lazy-1"]
    assert verdicts.pop("cmpl-lazy-1") == "FAIL" and f"seed {seed}" in lazy_verdict[0].message
    assert len(verdicts) == 4 + 4 + 3 + 4 + 2 and set(verdicts.values()) == {"OK"}, report.outcomes
    for name, (endpoint, body, response, ids) in got.items():
        report = verify_response(body, response, [node.node.receipt_path(i) for i in ids], trusted,
                                 endpoint=endpoint, model=str(node.ckpt), cache_dir=str(node.root / "jit"))
        assert report.exit_code == 0, (name, [o.message for o in report.outcomes])
        assert [o.kind for o in report.outcomes] == ["response"] + ["receipt"] * len(ids)
