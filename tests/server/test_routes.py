"""The routes beside the completions: /metrics (parsed by prometheus_client's own parser), /version,
/tokenize, /detokenize and /tokenizer_info in vLLM's shapes, and `--api-key` (Bearer auth on /v1/, as
vLLM)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from threaded_server import threaded_server

from detent_audit import __version__
from detent_audit.engine.llm import LLM
from detent_audit.manifests.keys import load_private_key
from detent_audit.runtime.tokenizer import Tokenizer
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.node import ServingNode

if TYPE_CHECKING:
    from conftest import Env, Live

MODEL_NAME = "tiny-llama"  # conftest.MODEL_NAME


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_as_prometheus_text_and_count_what_was_served(live: Live) -> None:
    rng = random.Random()
    sent = [rng.randint(1, 6) for _ in range(3)]
    prompt_tokens = 0
    for n in sent:
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(2, 9))]
        prompt_tokens += len(prompt)
        r = httpx.post(f"{live.url}/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": n, "ignore_eos": True})
        assert r.status_code == 200, r.text
    bad = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL_NAME, "prompt": 7})
    assert bad.status_code == 400
    r = httpx.get(f"{live.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(r.text)
    route = (("route", "/v1/completions"),)
    assert samples[("detent_requests_total", (*route, ("status", "200")))] == len(sent)
    assert samples[("detent_requests_total", (*route, ("status", "400")))] == 1
    assert samples[("detent_generation_tokens_total", ())] == sum(sent)
    assert samples[("detent_prompt_tokens_total", ())] == prompt_tokens
    written = len(list((live.out / "receipts").glob("*.receipt")))
    assert samples[("detent_receipts_written_total", ())] == written
    assert samples[("detent_receipts_written_total", ())] == len(sent)
    assert samples[("detent_storage_errors_total", ())] == 0
    assert samples[("detent_queue_depth", ())] == 0
    assert samples[("detent_generation_tokens_per_second", ())] == pytest.approx(sum(sent) / 60.0)
    assert httpx.get(f"{live.url}/version").json() == {"version": __version__}


def test_tokenize_and_detokenize_in_vllms_shapes(env: Env, live: Live) -> None:
    tokenizer = Tokenizer.from_pretrained(env.checkpoint)
    text = "".join(random.choice("abcdefgh ijkl.") for _ in range(40))
    r = httpx.post(f"{live.url}/tokenize",
                   json={"model": MODEL_NAME, "prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert body["token_strs"] == [tokenizer.decode([t], False) for t in body["tokens"]]
    bare = httpx.post(f"{live.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{live.url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    back = httpx.post(f"{live.url}/detokenize", json={"model": MODEL_NAME, "tokens": bare["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(bare["tokens"])}
    for route, bad, param in [("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "extra": 1}, "extra")]:
        r = httpx.post(f"{live.url}{route}", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{live.url}/tokenize", json={"model": "gpt-4o", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_needs(live: Live) -> None:
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(f"{live.url}/v1/completions")
    remote = RemoteTokenizer(f"{live.url}/v1/completions")
    tokenizer = live.engine.tokenizer
    assert remote.eos_token_id in tokenizer.eos_token_ids
    text = "Question: what is two plus two?\nAnswer:"
    assert remote.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    assert httpx.get(f"{live.url}/tokenizer_info").json()["chat_template"] == tokenizer.chat_template


@pytest.fixture
def keyed(env: Env, tmp_path: Path) -> Any:
    llm = LLM(env.engine_config())
    node = ServingNode(llm, load_private_key(env.key.private_path), tmp_path / "out")
    engine = AsyncEngine(llm)
    token = f"sk-{random.getrandbits(64):016x}"
    try:
        with threaded_server(create_app(engine, node, MODEL_NAME, api_key=token)) as url:
            yield url, token
    finally:
        engine.shutdown(drain=False)


def test_an_api_key_refuses_a_wrong_or_missing_bearer_token_with_401(keyed: Any) -> None:
    url, token = keyed
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
    for headers in ({}, {"Authorization": f"Bearer {token}x"}, {"Authorization": token},
                    {"Authorization": f"Basic {token}"}):
        for method, route in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            r = httpx.request(method, f"{url}{route}", json=body if method == "POST" else None,
                              headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=1)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices[0].finish_reason
    assert httpx.get(f"{url}/health").status_code == 200  # open, as vLLM's
    samples = _samples(httpx.get(f"{url}/metrics").text)
    assert samples[("detent_requests_total", (("route", "/v1/completions"), ("status", "401")))] == 5


def test_serve_names_the_signing_key_apart_from_the_api_key(env: Env, tmp_path: Path) -> None:
    """`--signing-key` is the node's private key, `--api-key` the clients' token; the old `--key` still works
    with a warning, and no mistyped option is answered with a suggestion to pass the signing key."""
    from typer.testing import CliRunner

    from detent_audit.cli import app

    runner = CliRunner()
    for typo in ("--apikey", "--api-keys", "--keys", "--api_key"):
        res = runner.invoke(app, ["serve", typo, "x"])
        assert res.exit_code == 2 and "No such option" in res.output, res.output
        offered = res.output.partition("Possible options:")[2].partition(")")[0].replace(",", " ").split()
        assert "--key" not in offered and "--signing-key" not in offered, res.output
    res = runner.invoke(app, ["serve", "--key", str(env.key.private_path), "--manifest-out",
                              str(tmp_path / "o"), "--rotate", "0"])
    assert res.exit_code == 2 and "--key is deprecated" in res.stderr and "--rotate must be" in res.stderr
    res = runner.invoke(app, ["serve", "--manifest-out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--signing-key FILE" in res.stderr
    res = runner.invoke(app, ["info", "--model", str(env.checkpoint), "--checkpoint-path"])
    assert res.exit_code == 0 and res.stdout.strip() == str(env.checkpoint), res.output
