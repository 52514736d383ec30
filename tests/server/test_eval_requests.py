"""What lm-eval sends, answered as vLLM's server answers it: batched token-id prompts (a choice and a receipt
each), echo with prompt logprobs and top-n (max_tokens 0 and 1), stop strings (text cut, stop_reason, the
strings in the receipt); each choice's bits equal the same prompt served alone."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import httpx

from detent_audit.manifests.receipt import verify_envelope

if TYPE_CHECKING:
    from conftest import Live

MODEL_NAME = "tiny-llama"  # the live server's (conftest)


def _post(live: Live, body: dict) -> dict:
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL_NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _receipt(live: Live, env, rid: str):
    return verify_envelope((live.out / "receipts" / f"{rid}.receipt").read_bytes(), env.trusted).receipt


def test_a_batch_of_echo_prompts_gets_one_receipt_each_and_the_bits_of_each_alone(live: Live, env) -> None:
    rng = random.Random()
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 40))] for _ in range(5)]
    for max_tokens in (1, 0):
        body = {"prompt": prompts, "echo": True, "max_tokens": max_tokens, "logprobs": 1, "temperature": 0}
        batch = _post(live, body)
        assert [c["index"] for c in batch["choices"]] == list(range(5))
        assert len(batch["receipt_ids"]) == 5
        assert batch["receipt_ids"] == [c["receipt_id"] for c in batch["choices"]]
        for prompt, choice in zip(prompts, batch["choices"]):
            alone = _post(live, {**body, "prompt": prompt})["choices"][0]
            # fp32 values written exactly: equal JSON, equal bits
            assert alone["logprobs"] == choice["logprobs"]
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(prompt) + max_tokens and lp["token_logprobs"][0] is None
            assert all(max(top.values()) >= v
                       for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]))
            r = _receipt(live, env, choice["receipt_id"])
            assert list(r.request.prompt_token_ids) == prompt and r.request.sampling.max_tokens == max_tokens
            assert list(r.scoring.logprobs) == lp["token_logprobs"][1:len(prompt)]
            best = [max(x.values()) for x in lp["top_logprobs"][1:len(prompt)]]
            assert [t[0][1] for t in r.scoring.tops] == best
            assert len(r.output.token_ids) == max_tokens


def test_stop_strings_cut_the_text_and_are_recorded(live: Live, env) -> None:
    prompt = [random.randrange(3, 250) for _ in range(8)]
    free = _post(live, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    text = free["choices"][0]["text"]
    stop = text[5:7] if len(text) >= 7 and "\ufffd" not in text[5:7] else None
    if stop is None:
        return  # this prompt's output is too short to take a stop string from
    got = _post(live, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                       "stop": ["\x01nowhere", stop]})["choices"][0]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
    assert got["text"] == text[:text.index(stop)]
    r = _receipt(live, env, got["receipt_id"])
    assert r.request.sampling.stop == ("\x01nowhere", stop) and r.output.finish_reason == "stop"
