"""The OpenAI-compatible server end to end: the real `openai` client against a live server on 127.0.0.1,
receipts on disk equal to what the responses carried (token ids and logprob bits), 400s and 503s, 64 mixed
concurrent requests verified by `detent-audit verify`, tampered receipts caught at the changed position."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from typer.testing import CliRunner

from detent_audit.cli import app as cli_app
from detent_audit.manifests.keys import load_private_key
from detent_audit.manifests.receipt import OutputRecord, Receipt, sign_receipt, verify_envelope

if TYPE_CHECKING:
    from conftest import Env, Live

MODEL_NAME = "tiny-llama"  # conftest.MODEL_NAME


def _has_command(name: str) -> bool:
    return any((c.name or c.callback.__name__.replace("_", "-")) == name for c in cli_app.registered_commands)


needs_verify = pytest.mark.skipif(not _has_command("verify"),
                                  reason="`detent-audit verify` is not registered yet")


def _receipt(env: Env, out: Path, receipt_id: str) -> Receipt:
    path = out / "receipts" / f"{receipt_id}.receipt"
    assert path.is_file(), f"no receipt file for {receipt_id}"
    return verify_envelope(path.read_bytes(), env.trusted).receipt


def _f32le(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _ids(tokens: list[str]) -> tuple[int, ...]:
    return tuple(int(t.removeprefix("token_id:")) for t in tokens)


def _client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _verify(env: Env, *args: str) -> tuple[int, Any]:
    result = CliRunner().invoke(cli_app, ["verify", *args, "--key", str(env.key.public_path), "--model",
                                          str(env.checkpoint), "--cache-dir", str(env.cache_dir), "--json"])
    try:
        return result.exit_code, json.loads(result.stdout)
    except ValueError:
        raise AssertionError(f"verify printed no JSON (exit {result.exit_code}): {result.output}") from None


def test_completions_round_trip_through_the_openai_client(env: Env, live: Live) -> None:
    client, rng = _client(live), random.Random(1)
    prompt = [rng.randrange(256) for _ in range(12)]
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0.9, top_p=0.95,
                                  seed=1234, logprobs=3,
                                  extra_body={"top_k": 40, "ignore_eos": True,
                                              "return_tokens_as_token_ids": True})
    raw = client.completions.with_raw_response.create(**kwargs)
    resp = raw.parse()
    assert raw.headers["x-detent-receipt"] == resp.receipt_id == resp.id
    lp = resp.choices[0].logprobs
    receipt = _receipt(env, live.out, resp.receipt_id)
    ids = _ids(lp.tokens)
    assert receipt.output.token_ids == ids and len(ids) == 8
    # the response's floats are the fp32 bits
    assert receipt.output.logprobs_f32le == _f32le(lp.token_logprobs)
    assert receipt.request.prompt_token_ids == tuple(prompt) and receipt.request.seed == 1234
    s = receipt.request.sampling
    assert ((s.temperature, s.top_p, s.top_k, s.max_tokens, s.ignore_eos, s.logprobs)
            == (0.9, 0.95, 40, 8, True, 3))
    assert resp.choices[0].text == live.llm.tokenizer.decode(list(ids))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the top 3, plus the sampled token if not among them
        assert top[token] == value and 3 <= len(top) <= 4
    assert resp.usage.prompt_tokens == 12 and resp.usage.completion_tokens == 8

    # the same request streamed: the same bits, chunk by chunk, and a receipt of its own in the last chunk
    chunks = list(client.completions.create(stream=True, **kwargs))
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length" and final.receipt_id != resp.receipt_id
    streamed = [c.choices[0] for c in chunks if c.choices[0].logprobs]
    assert _ids([t for c in streamed for t in c.logprobs.tokens]) == ids
    assert _f32le([v for c in streamed for v in c.logprobs.token_logprobs]) == receipt.output.logprobs_f32le
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    again = _receipt(env, live.out, final.receipt_id)
    assert again.output == receipt.output and again.request.request_id == final.receipt_id


def test_chat_round_trip_through_the_openai_client(env: Env, live: Live) -> None:
    client = _client(live)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.7, seed=7,
                                  logprobs=True, top_logprobs=2,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    raw = client.chat.completions.with_raw_response.create(**kwargs)
    resp = raw.parse()
    assert raw.headers["x-detent-receipt"] == resp.receipt_id
    content = resp.choices[0].logprobs.content
    receipt = _receipt(env, live.out, resp.receipt_id)
    assert receipt.request.prompt_token_ids == tuple(live.llm.tokenizer.encode_chat(messages))
    assert receipt.output.token_ids == _ids([c.token for c in content])
    assert receipt.output.logprobs_f32le == _f32le([c.logprob for c in content])
    assert receipt.request.seed == 7 and receipt.request.sampling.logprobs == 2
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 2 and values == sorted(values, reverse=True)
    assert resp.choices[0].message.content == live.llm.tokenizer.decode(list(receipt.output.token_ids))

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    finish = chunks[-2]
    assert finish.choices[0].finish_reason == "length" and finish.receipt_id == chunks[-1].receipt_id
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    again = _receipt(env, live.out, finish.receipt_id)
    assert again.output == receipt.output
    assert again.output.logprobs_f32le == _f32le([e.logprob for e in streamed])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content


def test_stream_wire_format_and_receipt_before_the_final_chunk(env: Env, live: Live) -> None:
    body = {"model": MODEL_NAME, "prompt": "The receipt", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        header = r.headers["x-detent-receipt"]
        events = []
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            events.append(line.removeprefix("data: "))
            if '"receipt_id"' in line:  # the receipt is on disk before this chunk was sent
                assert (live.out / "receipts" / f"{header}.receipt").is_file()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["receipt_id"] == header and last["choices"][0]["finish_reason"] == "length"
    assert [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]] == [None] * 5
    assert _receipt(env, live.out, header).request.sampling.temperature == 0.0


def test_models_and_health(live: Live) -> None:
    models = httpx.get(f"{live.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    missing = httpx.get(f"{live.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"


BAD = [  # (endpoint, body, param, fragment of the message)
    ("completions", b"{not json", None, "not valid JSON"),
    ("completions", b"[1, 2]", None, "must be a JSON object"),
    ("completions", b"[" * 100_000, None, "not valid JSON"),
    ("completions", b'{"prompt": "x", "max_tokens": 2, "max_tokens": 900}', None,
     "'max_tokens' appears more than once"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "must be an integer"),
    ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "must be an integer"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "must be in [1, inf]"),
    ("completions", {"prompt": "x", "temperature": -0.5}, "temperature", "must be in [0, inf]"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "must be in (0, 1]"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p", "must be in [0, 1]"),
    ("completions", {"prompt": "x", "seed": -1}, "seed", "must be in [0, 18446744073709551615]"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "must be in [0, 20]"),
    ("completions", {"prompt": "x", "n": 0}, "n", "must be in [1, 256]"),
    ("completions", {"prompt": ["a", "b"], "n": 129}, "n", "more than the 256 choices"),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of", "'best_of' 3 is not 'n' 1"),
    ("completions", {"prompt": "x", "echo": True, "stream": True}, "stream", "answered whole, not streamed"),
    ("completions", {"prompt": "x", "echo": 1}, "echo", "must be a boolean"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop", "1-256 characters"),
    ("completions", {"prompt": "x", "stop": ["a\ufffd"]}, "stop", "no U+FFFD"),
    ("completions", {"prompt": "x", "stop": [7]}, "stop", "each stop string"),
    ("completions", {"prompt": "x", "stop": ["s"] * 17}, "stop", "at most 16 strings"),
    ("completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "is not supported"),
    ("completions", {"prompt": "x", "colour": "red"}, "colour", "unrecognized request argument"),
    ("completions", {"prompt": ["a", "b"], "stream": True}, "stream", "answered whole, not streamed"),
    ("completions", {"prompt": [[1, 2], "b", [3.5]]}, "prompt", "a list of 1-256 of those"),
    ("completions", {"prompt": [[1, 2], []]}, "prompt", "a list of 1-256 of those"),
    ("completions", {"prompt": [[5] * 10, [5] * 2048]}, "prompt[1]", "leaves no room for output"),
    ("completions", {"prompt": [1, 99999]}, "prompt", "token ids in [0, 319]"),
    ("completions", {"prompt": [5] * 3000}, "prompt", "maximum context length is 2048 tokens"),
    ("completions", {"prompt": [5] * 2040, "max_tokens": 16}, "max_tokens", "the prompt has 2040 tokens"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "'stream': true"),
    ("completions", {"prompt": "x" * 10**6}, "prompt", "more than that many tokens can hold"),
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt", "lone surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "y" * 10**6}]}, "messages",
     "more than that many tokens can hold"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udfffz"}]}', "messages[0].content",
     "lone surrogate"),
    ("chat/completions", {"messages": []}, "messages", "non-empty list"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, "messages",
     "leaves no room"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "'role'"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs 'logprobs': true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools", "not supported"),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "fragment"), BAD, ids=[f"{b[0]}-{b[2]}-{i}"
                                                                            for i, b in enumerate(BAD)])
def test_bad_requests_get_400_with_a_message(live: Live, endpoint: str, body: Any, param: str | None,
                                             fragment: str) -> None:
    url = f"{live.url}/v1/{endpoint}"
    r = httpx.post(url, content=body) if isinstance(body, bytes) else httpx.post(url, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert "x-detent-receipt" not in r.headers and not list((live.out / "receipts").iterdir())


def test_an_oversized_body_is_413_while_it_is_read(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused from its Content-Length before reading, or, sent chunked with no length, as soon as the bytes
    read pass the limit: the server never holds more than the limit."""
    import detent_audit.server.bodies as app_module

    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 4096)
    body = json.dumps({"model": MODEL_NAME, "prompt": "z" * 8000}).encode()
    sent: list[int] = []

    def chunked():
        for i in range(0, len(body), 1000):
            sent.append(i)
            yield body[i:i + 1000]

    for content in (body, chunked()):
        r = httpx.post(f"{live.url}/v1/completions", content=content, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    small = httpx.post(f"{live.url}/v1/completions",
                       json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2})
    assert small.status_code == 200 and len(list(live.out.rglob("*.receipt"))) == 1


def test_a_client_that_leaves_frees_its_slot_and_gets_no_receipt(serve_live: Any, tmp_path: Path) -> None:
    """A stream closed after its first chunk and a non-streamed request whose client times out are aborted
    before they finish: the engine stops computing for them, their queue slots free up, no receipt is
    signed for a response nobody received, and the server goes on serving."""
    with serve_live(tmp_path / "out", max_queued=2) as live:
        steps, original = [0], live.llm.step

        def counted() -> list:
            steps[0] += 1
            return original()

        live.llm.step = counted
        long = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**long, "stream": True},
                          timeout=30) as r:
            next(r.iter_lines())  # the first chunk, then the client hangs up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=long, timeout=1.0)
        deadline = time.monotonic() + 30
        while live.engine.num_outstanding:
            assert time.monotonic() < deadline, "an abandoned request kept its slot"
            time.sleep(0.02)
        assert steps[0] < 1500  # aborted: not run to their 2,000 tokens
        assert not list((live.out / "receipts").iterdir())
        ok = httpx.post(f"{live.url}/v1/completions", json={**long, "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200
        assert live.llm.scheduler.block_manager.stats.num_used_blocks == 0  # the aborted ones' freed too
    assert [p.stem for p in (tmp_path / "out" / "receipts").iterdir()] == [ok.json()["receipt_id"]]


def test_unknown_model_is_404_and_the_client_raises(live: Live) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(live).completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="'best_of' 2 is not 'n' 1"):
        _client(live).completions.create(model=MODEL_NAME, prompt="x", best_of=2)


def test_a_full_queue_answers_503_at_once(serve_live: Any, tmp_path: Path) -> None:
    with serve_live(tmp_path / "out", max_queued=1) as live:
        gate, original = threading.Event(), live.llm.step

        def gated_step() -> list:
            gate.wait(30)
            return original()

        live.llm.step = gated_step  # the engine thread blocks in its first step until the gate opens
        body = {"model": MODEL_NAME, "prompt": "queued", "max_tokens": 3}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{live.url}/v1/completions", json=body, timeout=30)
            deadline = time.monotonic() + 10
            while live.engine.num_outstanding < 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            for extra in ({}, {"stream": True}):
                full = httpx.post(f"{live.url}/v1/completions", json={**body, **extra}, timeout=5)
                assert full.status_code == 503 and full.headers["retry-after"] == "1"
                assert full.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.InternalServerError):
                _client(live).chat.completions.create(model=MODEL_NAME,
                                                      messages=[{"role": "user", "content": "x"}])
            gate.set()
            answered = first.result()
        assert answered.status_code == 200
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 200


def test_an_engine_failure_fails_requests_instead_of_hanging(serve_live: Any, tmp_path: Path) -> None:
    with serve_live(tmp_path / "out") as live:
        original, calls = live.llm.step, []

        def failing_step() -> list:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("kernel exploded")
            return original()

        live.llm.step = failing_step
        body = {"model": MODEL_NAME, "prompt": "boom", "max_tokens": 10, "ignore_eos": True, "stream": True}
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
        assert events[-1] == "[DONE]" and "receipt_id" not in r.text
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_failed" and "kernel exploded" in error["message"]
        assert httpx.get(f"{live.url}/health").status_code == 503
        after = httpx.post(f"{live.url}/v1/completions", json={**body, "stream": False}, timeout=5)
        assert after.status_code == 503 and "stopped after an error" in after.json()["error"]["message"]
        assert not list((live.out / "receipts").iterdir())


def _mixed_specs() -> list[dict[str, Any]]:
    rng = random.Random(64)
    specs = []
    for i in range(64):
        spec: dict[str, Any] = {"model": MODEL_NAME, "seed": rng.randrange(2**32),
                                "max_tokens": rng.randint(1, 16),
                                "temperature": rng.choice([0.0, 0.0, 0.8, 1.0]),
                                "top_p": rng.choice([1.0, 0.9]),
                                "stream": i % 3 == 0}
        extra = {"top_k": rng.choice([0, 20]), "ignore_eos": rng.random() < 0.5}
        if i % 4 == 2:
            spec["messages"] = [{"role": "user", "content": "word " * rng.randint(1, 30)}]
        elif i % 4 == 3:  # shared prefixes: prefix-cache hits
            spec["prompt"] = [7] * 32 + [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        else:
            spec["prompt"] = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 90)))
        if i % 5 == 1:  # top-n alternatives asked for: the receipt still holds the chosen tokens' bits
            n = rng.randint(0, 3)
            spec.update({"logprobs": True, "top_logprobs": n} if "messages" in spec else {"logprobs": n})
        spec["extra_body"] = extra
        specs.append(spec)
    return specs


async def _serve_mixed(live: Live, specs: list[dict[str, Any]]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)

    async def one(spec: dict[str, Any]) -> str:
        spec = dict(spec)
        api = client.chat.completions if "messages" in spec else client.completions
        if not spec.pop("stream"):
            return (await api.create(**spec)).receipt_id
        last = None
        async for chunk in await api.create(stream=True, **spec):
            last = chunk
        return last.receipt_id

    try:
        return await asyncio.gather(*(one(s) for s in specs))
    finally:
        await client.close()


@needs_verify
def test_64_mixed_concurrent_requests_verify_by_rescore_and_replay(env: Env, serve_live: Any,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "out"
    with serve_live(out, max_num_seqs=16, max_num_batched_tokens=128) as live:
        receipt_ids = asyncio.run(_serve_mixed(live, _mixed_specs()))
    assert len(set(receipt_ids)) == 64
    assert sorted(p.stem for p in (out / "receipts").glob("*.receipt")) == sorted(receipt_ids)
    assert len(list((out / "manifests").glob("*.manifest"))) == 1  # written at shutdown
    for mode in ("rescore", "replay"):
        code, report = _verify(env, str(out), "--mode", mode)
        assert code == 0, report
        assert report["counts"]["OK"] == 65  # 64 receipts and the run manifest


@needs_verify
def test_a_tampered_receipt_fails_at_the_changed_position(env: Env, serve_live: Any, tmp_path: Path) -> None:
    with serve_live(tmp_path / "out") as live:
        body = {"model": MODEL_NAME, "prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        rid = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).json()["receipt_id"]
        decode = live.llm.tokenizer.decode
    receipt = _receipt(env, tmp_path / "out", rid)
    key, pos, out = load_private_key(env.key.private_path), 3, receipt.output
    bits = bytearray(out.logprobs_f32le)
    bits[4 * pos] ^= 1  # the lowest mantissa bit of logprob `pos`
    tokens = list(out.token_ids)
    tokens[pos] = (tokens[pos] + 1) % 256
    cases = {"intact": out,
             "logprob-bit": OutputRecord(out.token_ids, bytes(bits), out.finish_reason, out.text),
             "token": OutputRecord(tuple(tokens), out.logprobs_f32le, out.finish_reason, decode(tokens))}
    for name, output in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        tampered = dataclasses.replace(receipt, output=output)
        (folder / f"{rid}.receipt").write_bytes(sign_receipt(tampered, key))
        code, report = _verify(env, str(folder / f"{rid}.receipt"))
        (outcome,) = report["outcomes"]
        if name == "intact":
            assert code == 0 and outcome["status"] == "OK", report
            continue
        assert code == 1 and outcome["status"] == "FAIL", report
        assert outcome["divergence"]["position"] == pos, report


def test_more_stop_token_ids_than_a_receipt_records_are_refused_before_computing(live: Live) -> None:
    """A body of 1,025 stop token ids was computed and then failed at signing (a 500 with a traceback): it is
    a 400 naming the field, nothing computed, no receipt; 1,024 are served and signed."""
    ids = [random.randrange(3, 200) for _ in range(1025)]
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(f"{live.url}/v1/completions", json={**body, "stop_token_ids": ids}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    assert "1024" in r.json()["error"]["message"] and not list((live.out / "receipts").glob("*.receipt"))
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(f"{live.url}/v1/chat/completions", json={**chat, "stop_token_ids": ids}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    r = httpx.post(f"{live.url}/v1/completions", json={**body, "stop_token_ids": ids[:1024]}, timeout=60)
    assert r.status_code == 200 and _receipt_count(live) == 1, r.text


def _receipt_count(live: Live) -> int:
    return len(list((live.out / "receipts").glob("*.receipt")))


def test_a_lone_surrogate_in_an_ignored_field_is_a_400_naming_it(live: Live) -> None:
    """Not a 413 (the body is small): the field that is not Unicode text is named."""
    for raw, param in ((b'{"model": "tiny-llama", "prompt": [5], "user": "a\\ud800"}', "user"),
                       (b'{"model": "tiny-llama", "prompt": [5], "stop": ["x", "\\udc00"]}', "stop")):
        r = httpx.post(f"{live.url}/v1/completions", content=raw)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "surrogate" in r.json()["error"]["message"], r.text
    assert _receipt_count(live) == 0


def test_a_model_the_server_does_not_serve_is_404_on_every_endpoint(live: Live) -> None:
    """OpenAI's error shape, as vLLM answers it; the openai client raises NotFoundError."""
    for call in (lambda c: c.completions.create(model="gpt-4o", prompt="x", max_tokens=1),
                 lambda c: c.chat.completions.create(model="gpt-4o", max_tokens=1,
                                                     messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(openai.NotFoundError) as caught:
            call(_client(live))
        assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert _receipt_count(live) == 0
