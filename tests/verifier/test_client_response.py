"""`verify-response`, a client's check of what it sent and received against the node's receipts, on the real
server's responses (chat, completions, streams, echo, a batch): the honest ones pass, and each response or
receipt a node holding the key could forge FAILs, naming the field; what the client's OpenAI SDK shows is
read with the SDK's own response models."""

from __future__ import annotations

import copy
import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from threaded_server import threaded_server
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.errors import BadInput
from detent_audit.manifests.dsse import Envelope
from detent_audit.manifests.encoding import facts_hash
from detent_audit.manifests.keys import load_private_key, load_trusted_keys
from detent_audit.manifests.receipt import ClientRequest, sign_receipt, verify_envelope
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import API as OFFLINE_API
from detent_audit.server.offline import parse_line, serve_offline
from detent_audit.server.protocol import Limits, parse_request
from detent_audit.verifier.client import Signed, check_response, verify_response
from detent_audit.verifier.expected_response import model_tokenizer
from detent_audit.verifier.response_view import CHAT, COMPLETIONS

runner = CliRunner()
MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Name a city."}]
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        CHAT,
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 6,
            "temperature": 0.8,
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    "chat-stream": (
        CHAT,
        {
            "messages": MESSAGES,
            "max_tokens": 5,
            "temperature": 0.8,
            "seed": 4,
            "logprobs": True,
            "top_logprobs": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "completion": (
        COMPLETIONS,
        {
            "model": MODEL,
            "prompt": "The capital of",
            "max_tokens": 5,
            "temperature": 0.7,
            "seed": 5,
            "logprobs": 2,
            "ignore_eos": True,
        },
    ),
    "completion-stream": (
        COMPLETIONS,
        {"prompt": "Once upon", "max_tokens": 4, "logprobs": 0, "stream": True, "ignore_eos": True},
    ),
    "echo": (
        COMPLETIONS,
        {
            "prompt": "Echo this",
            "echo": True,
            "max_tokens": 2,
            "logprobs": 2,
            "temperature": 0,
            "ignore_eos": True,
        },
    ),
    "echo-ids-only": (COMPLETIONS, {"prompt": [5, 6, 7, 8], "echo": True, "max_tokens": 0, "logprobs": 1}),
    "batch": (
        COMPLETIONS,
        {
            "prompt": ["First", [9, 8, 7]],
            "max_tokens": 3,
            "logprobs": 1,
            "temperature": 0.5,
            "seed": 9,
            "ignore_eos": True,
        },
    ),
}


class Exchange(NamedTuple):
    endpoint: str
    request: dict[str, Any]
    response: Any  # the body, or a stream's chunks
    receipts: list[Path]  # one per prompt


def _verify_cli(served: dict, *args: object) -> Any:
    """`detent-audit verify ARGS` with the served node's key, model and JIT cache."""
    return runner.invoke(app, ["verify", *map(str, args), "--key", str(served["key"].public_path), "--model",
                               str(served["ckpt"]), "--cache-dir", str(served["jit"])])


def _chunks(text: str) -> list[dict]:
    return [
        json.loads(line[5:])
        for line in text.splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]


@pytest.fixture(scope="module")
def served(new_node) -> dict:
    """The tiny model served over HTTP; every request of `REQUESTS` sent once, its response and receipts
    kept."""
    root, ckpt, key, llm, node = new_node("client")
    node.publish(root / "deployment.json")
    exchanges = {}
    with (
        threaded_server(create_app(AsyncEngine(llm), node, MODEL)) as url,
        httpx.Client(base_url=url, timeout=300) as http,
    ):
        for name, (endpoint, body) in REQUESTS.items():
            got = http.post(endpoint, json=body)
            assert got.status_code == 200, got.text
            response = _chunks(got.text) if body.get("stream") else got.json()
            ids = (
                response["receipt_ids"]
                if isinstance(response, dict) and "receipt_ids" in response
                else [got.headers["X-Detent-Receipt"]]
            )
            exchanges[name] = Exchange(endpoint, body, response, [node.receipt_path(i) for i in ids])
    trusted = load_trusted_keys(key.public_path)
    return {
        "root": root,
        "ckpt": ckpt,
        "key": key,
        "llm": llm,
        "trusted": trusted,
        "exchanges": exchanges,
        "private": load_private_key(key.private_path),
        "jit": root / "jit",
        "tokenizer": model_tokenizer(str(ckpt), str(root / "jit")),
    }


def _signed(s: dict, paths: list[Path]) -> list[Signed]:
    return [
        Signed(verify_envelope(p.read_bytes(), s["trusted"]).receipt, Envelope.from_bytes(p.read_bytes()))
        for p in paths
    ]


def _problems(s: dict, name: str, response: Any = None, request: Any = None, **kw: Any) -> list[str]:
    x = s["exchanges"][name]
    return check_response(
        x.request if request is None else request,
        x.response if response is None else response,
        _signed(s, x.receipts),
        tokenizer=s["tokenizer"],
        **kw,
    ).problems


def _cli(
    s: dict, folder: Path, request: Any, response: Any, receipts: list[Path], *extra: str
) -> tuple[int, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "req.json").write_text(json.dumps(request))
    (folder / "resp.json").write_text(json.dumps(response))
    res = runner.invoke(
        app,
        [
            "verify-response",
            "--request",
            str(folder / "req.json"),
            "--response",
            str(folder / "resp.json"),
            *[a for p in receipts for a in ("--receipt", str(p))],
            "--key",
            str(s["key"].public_path),
            "--model",
            str(s["ckpt"]),
            "--cache-dir",
            str(s["jit"]),
            *extra,
        ],
    )
    return res.exit_code, res.output


def _sdk(model: type, value: Any) -> Any:
    """`value` as the OpenAI SDK builds its response objects (without validation: `construct_type`)."""
    return construct_type(type_=model, value=value)


def _sdk_texts(endpoint: str, response: Any) -> dict[int, str]:
    """Per choice index, the text the OpenAI SDK's own models show a client."""
    texts: dict[int, str] = {}
    if isinstance(response, list):
        model = ChatCompletionChunk if endpoint == CHAT else Completion
        for chunk in (_sdk(model, c) for c in response):
            for c in chunk.choices:
                piece = c.delta.content if endpoint == CHAT else c.text
                texts[c.index] = texts.get(c.index, "") + (piece or "")
        return texts
    if endpoint == CHAT:
        return {i: c.message.content for i, c in enumerate(_sdk(ChatCompletion, response).choices)}
    return {i: c.text for i, c in enumerate(_sdk(Completion, response).choices)}


def test_honest_responses_of_every_kind_pass_including_echo_and_a_batch(served) -> None:
    """Each response the server gave passes the client's check, and the SDK shows each receipt's text; echo
    (prompt and output, prompt scored) and a batch (one receipt per choice) pass whole, with `verify`."""
    for name, x in served["exchanges"].items():
        assert _problems(served, name) == [], name
        receipts = [s.receipt for s in _signed(served, x.receipts)]
        shown = _sdk_texts(x.endpoint, x.response)
        assert sorted(shown) == list(range(len(receipts))), name
        for i, r in enumerate(receipts):
            assert shown[i].endswith(r.output.text), name
    for name in ("echo", "batch", "echo-ids-only", "chat-stream"):
        x = served["exchanges"][name]
        paths = x.receipts[0] if len(x.receipts) == 1 else x.receipts
        report = verify_response(
            x.request,
            x.response,
            paths,
            served["trusted"],
            model=str(served["ckpt"]),
            cache_dir=str(served["jit"]),
        )
        assert report.exit_code == 0, (name, [o.message for o in report.outcomes])
        assert [o.kind for o in report.outcomes] == ["response"] + ["receipt"] * len(x.receipts)


def _chat_forgeries(x: Exchange, text: str) -> dict[str, tuple[str, Any, str]]:
    """Chat responses whose SDK view says "Berlin" while the receipt's text sits in another field."""
    body = x.response
    choice = body["choices"][0]
    berlin = {**choice, "message": {"role": "assistant", "content": "Berlin"}}
    return {
        "a text field in a chat choice": (
            "chat",
            {**body, "choices": [{**berlin, "text": text}]},
            "choices[0].text",
        ),
        "a delta beside the message": (
            "chat",
            {**body, "choices": [{**berlin, "delta": {"content": text}}]},
            "choices[0].delta",
        ),
        "the text moved to choices[1]": (
            "chat",
            {**body, "choices": [berlin, {**choice, "index": 1}]},
            "choices[1]",
        ),
        "a refusal beside an empty content": (
            "chat",
            {
                **body,
                "choices": [{**choice, "message": {"role": "assistant", "content": "", "refusal": text}}],
            },
            "choices[0].message.refusal",
        ),
    }


def _stream_forgeries(chat: Exchange, completion: Exchange) -> dict[str, tuple[str, Any, str]]:
    """Streams whose chunks carry the receipt's pieces in the field the SDK does not read, another text in the
    one it does."""
    chat_chunks = copy.deepcopy(chat.response)
    for c in chat_chunks:
        for choice in c["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                choice["text"], delta["content"] = delta["content"], "Berlin"
    completion_chunks = copy.deepcopy(completion.response)
    for c in completion_chunks:
        for choice in c["choices"]:
            if choice.get("text"):
                choice["delta"], choice["text"] = {"content": choice["text"]}, "Berlin"
    return {
        "chat chunks whose text and delta disagree": ("chat-stream", chat_chunks, ".text"),
        "completion chunks whose text and delta disagree": ("completion-stream", completion_chunks, ".delta"),
    }


def test_text_the_clients_sdk_does_not_show_fails_naming_the_field(served, tmp_path) -> None:
    """The receipt's text in a chat choice's `text`, in a `delta` beside the `message`, in `choices[1]`, in a
    refusal, or in the stream field the SDK does not read: the SDK shows the client other text, and the check
    FAILs naming the field."""
    chat = served["exchanges"]["chat"]
    text = _signed(served, chat.receipts)[0].receipt.output.text
    cases = {
        **_chat_forgeries(chat, text),
        **_stream_forgeries(served["exchanges"]["chat-stream"], served["exchanges"]["completion-stream"]),
    }
    for what, (name, response, field) in cases.items():
        x = served["exchanges"][name]
        receipt = _signed(served, x.receipts)[0].receipt
        assert _sdk_texts(x.endpoint, response).get(0) != receipt.output.text, (
            what
        )  # the client saw other text
        problems = _problems(served, name, response)
        assert any(field in p for p in problems), (what, problems)
    _, response, _ = cases["a text field in a chat choice"]
    code, out = _cli(served, tmp_path, chat.request, response, chat.receipts)
    assert code == 1 and "FAIL:" in out and "choices[0].text" in out, out


def test_a_chat_body_signed_as_an_offline_line_fails_in_verify_and_verify_response(served, tmp_path) -> None:
    """A chat body without `model`, answered as an offline line would be (greedy, 16 tokens) and signed as
    one: `verify`, `verify --deployment` and `verify-response` refuse it. No body is admitted by two kinds: a
    line is bound with its id (one the node gave it, for a line without), and the HTTP endpoints refuse an
    `id`."""
    s, llm = served, served["llm"]
    body = {"messages": MESSAGES}
    rid, ids, params = parse_line(
        body, "chatcmpl-forged", llm.tokenizer, llm.max_model_len, llm.vocab_size, "x"
    )
    assert params.temperature == 0 and params.max_tokens == 16
    (out,) = llm.generate([ids], params)
    node = ServingNode(llm, s["private"], tmp_path / "node")
    signed = node.sign(out, params, rid, ClientRequest.of(OFFLINE_API, body))
    node.close()
    folder = tmp_path / "forged"
    folder.mkdir()
    path = folder / signed.path.name
    path.write_bytes(signed.path.read_bytes())
    for extra in ((), ("--deployment", str(s["root"] / "deployment.json"))):
        res = _verify_cli(s, str(path), "--json", *extra)
        (o,) = [o for o in json.loads(res.stdout)["outcomes"] if o["kind"] == "receipt"]
        assert res.exit_code == 1 and o["status"] == "FAIL" and "no input line" in o["message"], (extra, o)
    proof = signed.client_proof
    r = signed.receipt
    response = {
        "id": rid,
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "system_fingerprint": r.deployment_hash,
        "seed": r.request.seed,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": r.output.text},
                "finish_reason": r.output.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": len(ids),
            "completion_tokens": len(out.token_ids),
            "total_tokens": len(ids) + len(out.token_ids),
        },
        "receipt_id": rid,
        "receipt": proof,
    }
    problems = check_response(body, response, _signed(s, [path]), tokenizer=s["tokenizer"]).problems
    assert any(
        "signed the request as one to detent/v1/offline-jsonl; the client called /v1/chat/completions" in p
        for p in problems
    ), problems
    code, output = _cli(s, tmp_path / "cli", body, response, [path])
    assert code == 1 and "/v1/chat/completions" in output, output
    # the three kinds admit disjoint bodies: each honest body is refused by the other two parsers
    limits = Limits(MODEL, llm.max_model_len, llm.vocab_size)
    line = {"id": "l1", "messages": MESSAGES}
    for kind, honest in (
        ("chat", REQUESTS["chat"][1]),
        ("completions", REQUESTS["completion"][1]),
        ("line", line),
    ):
        admitted = []
        for parser, parse in (
            ("chat", lambda b: parse_request(b, True, limits, llm.tokenizer)),
            ("completions", lambda b: parse_request(b, False, limits, llm.tokenizer)),
            ("line", lambda b: parse_line(b, "x", llm.tokenizer, llm.max_model_len, llm.vocab_size, "x")),
        ):
            try:
                parse(honest)
                admitted.append(parser)
            except BadInput:
                pass
        assert admitted == [kind], (kind, admitted)
    # a line without an id is bound with the one it got, and verifies
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 3}) + "\n")
    node = ServingNode(llm, s["private"], tmp_path / "lines")
    serve_offline(llm, node, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    node.close()
    line_receipt = tmp_path / "lines" / "receipts" / "req-1.receipt"
    bound = verify_envelope(line_receipt.read_bytes(), s["trusted"]).receipt.request.client.body()
    assert bound == {"id": "req-1", "prompt_token_ids": [5, 6, 7], "max_tokens": 3}
    res = _verify_cli(s, str(tmp_path / "lines"))
    assert res.exit_code == 0, res.output


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_logprobs_are_compared_per_position_and_token_and_usage_and_model_against_the_receipt(served) -> None:
    """Relabelled, hidden or reordered alternatives, a rewritten token string or its bytes, one logprob bit,
    1,000 tokens billed for the receipt's count, and another model's name: each FAILs, naming the field."""
    comp, chat = served["exchanges"]["completion"].response, served["exchanges"]["chat"].response
    lp = comp["choices"][0]["logprobs"]
    top = lp["top_logprobs"][1]
    keys = list(top)
    assert len(keys) >= 2
    relabelled = {keys[1]: top[keys[0]], keys[0]: top[keys[1]], **{k: top[k] for k in keys[2:]}}
    hidden = {k: top[k] for k in keys[1:]}
    reordered = {k: top[k] for k in [keys[1], keys[0], *keys[2:]]}

    def completion_with(**block: Any) -> dict:
        return {**comp, "choices": [{**comp["choices"][0], "logprobs": {**lp, **block}}]}

    def at(values: list, i: int, value: Any) -> list:
        return [*values[:i], value, *values[i + 1 :]]

    entry = chat["choices"][0]["logprobs"]["content"][0]

    def chat_with(new_entry: dict) -> dict:
        content = at(chat["choices"][0]["logprobs"]["content"], 0, new_entry)
        return {**chat, "choices": [{**chat["choices"][0], "logprobs": {"content": content}}]}

    flipped = struct.unpack(
        "<f", (struct.unpack("<I", struct.pack("<f", lp["token_logprobs"][2]))[0] ^ 1).to_bytes(4, "little")
    )[0]
    cases = {
        "relabelled alternatives": (
            "completion",
            completion_with(top_logprobs=at(lp["top_logprobs"], 1, relabelled)),
            "choices[0].logprobs.top_logprobs[1]",
        ),
        "a hidden alternative": (
            "completion",
            completion_with(top_logprobs=at(lp["top_logprobs"], 1, hidden)),
            "choices[0].logprobs.top_logprobs[1]",
        ),
        "reordered alternatives": (
            "completion",
            completion_with(top_logprobs=at(lp["top_logprobs"], 1, reordered)),
            "choices[0].logprobs.top_logprobs[1]",
        ),
        "a rewritten token string": (
            "completion",
            completion_with(tokens=at(lp["tokens"], 0, "Berlin")),
            "choices[0].logprobs.tokens[0]",
        ),
        "one logprob bit": (
            "completion",
            completion_with(token_logprobs=at(lp["token_logprobs"], 2, flipped)),
            "choices[0].logprobs.token_logprobs[2]",
        ),
        "usage": (
            "completion",
            {**comp, "usage": {**comp["usage"], "completion_tokens": 1000}},
            "usage.completion_tokens",
        ),
        "model": ("completion", {**comp, "model": "gpt-4o"}, "response.model"),
        "a chat token string": ("chat", chat_with({**entry, "token": "Berlin"}), "content[0].token"),
        "a chat token's bytes": ("chat", chat_with({**entry, "bytes": [66]}), "content[0].bytes"),
        "chat alternatives swapped": (
            "chat",
            chat_with({**entry, "top_logprobs": entry["top_logprobs"][::-1]}),
            "content[0].top_logprobs[0]",
        ),
        "a chat alternative relabelled": (
            "chat",
            chat_with(
                {
                    **entry,
                    "top_logprobs": [
                        {**entry["top_logprobs"][0], "token": entry["top_logprobs"][1]["token"]},
                        entry["top_logprobs"][1],
                    ],
                }
            ),
            "content[0].top_logprobs[0].token",
        ),
    }
    assert entry["top_logprobs"][0]["logprob"] != entry["top_logprobs"][1]["logprob"]
    for what, (name, response, field) in cases.items():
        problems = _problems(served, name, response)
        assert any(field in p for p in problems), (what, problems)
    assert (
        _problems(
            served,
            "completion",
            completion_with(token_logprobs=at(lp["token_logprobs"], 2, _f32(lp["token_logprobs"][2]))),
        )
        == []
    )  # the same fp32 bits


@pytest.mark.parametrize(
    "kind",
    [
        "response-a-list",
        "choices-not-a-list",
        "choice-a-string",
        "logprobs-not-numbers",
        "receipt-missing",
        "receipt-not-msgpack",
        "request-invalid-utf8",
        "request-not-an-object",
    ],
)
def test_a_malformed_input_to_verify_response_is_a_fail_with_exit_2(served, tmp_path, kind: str) -> None:
    x = served["exchanges"]["completion"]
    request, response, receipts = x.request, copy.deepcopy(x.response), x.receipts
    raw_request = None
    if kind == "response-a-list":  # a JSON file is one response (a stream is its server-sent events)
        response = [response]
    elif kind == "choices-not-a-list":
        response["choices"] = {"0": response["choices"][0]}
    elif kind == "choice-a-string":
        response["choices"] = ["Berlin"]
    elif kind == "logprobs-not-numbers":
        lp = response["choices"][0]["logprobs"]
        lp["token_logprobs"] = ["-0.5"] + lp["token_logprobs"][1:]
        lp["top_logprobs"][0] = {k: "x" for k in lp["top_logprobs"][0]}
    elif kind == "receipt-missing":
        receipts = [tmp_path / "no-such.receipt"]
    elif kind == "receipt-not-msgpack":
        (tmp_path / "junk.receipt").write_bytes(b"\xc1 not msgpack")
        receipts = [tmp_path / "junk.receipt"]
    elif kind == "request-invalid-utf8":
        raw_request = json.dumps(request).encode().replace(b"The capital", b"The \xff capital")
    elif kind == "request-not-an-object":
        request = [request]
    code, out = _cli(served, tmp_path, request, response, receipts)
    if raw_request is not None:
        (tmp_path / "req.json").write_bytes(raw_request)
        res = runner.invoke(
            app,
            [
                "verify-response",
                "--request",
                str(tmp_path / "req.json"),
                "--response",
                str(tmp_path / "resp.json"),
                "--receipt",
                str(receipts[0]),
                "--key",
                str(served["key"].public_path),
                "--model",
                str(served["ckpt"]),
            ],
        )
        code, out = res.exit_code, res.output
    assert code == 2 and "FAIL" in out and "Traceback" not in out, (kind, code, out)


def test_a_chat_answer_cut_at_a_stated_context_says_so_in_its_verdict_line(served, tmp_path) -> None:
    """A chat request without max_tokens runs to the context's end; a node that states a context of the prompt
    plus 5 cuts it at 5 tokens. Without --deployment nothing refutes the stated limit: the receipt's own
    verdict line says it ends at the context the node states; against the published deployment it FAILs."""
    s, llm = served, served["llm"]
    prompt = llm.tokenizer.encode_chat(MESSAGES)
    stated = len(prompt) + 5
    for seed in range(1, 200):  # a client's seed whose draw meets no EOS in 5 tokens
        body = {"messages": MESSAGES, "seed": seed}
        parsed = parse_request(body, True, Limits(MODEL, stated, llm.vocab_size), llm.tokenizer)
        assert parsed.params.max_tokens == 5
        params = parsed.params
        (out,) = llm.generate([prompt], params)
        if out.finish_reason == "length":
            break
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    node = ServingNode(llm, s["private"], tmp_path / "node")
    honest = node.sign(
        out, params, "chatcmpl-cut", ClientRequest.of("openai/v1/chat/completions", body)
    ).receipt
    node.close()
    facts = json.loads(json.dumps(honest.deployment_facts, default=dict))
    facts["deployment"]["engine"]["max_model_len"] = stated
    forged = dataclasses.replace(honest, deployment_facts=facts, deployment_hash=facts_hash(facts))
    path = tmp_path / "cut" / "chatcmpl-cut.receipt"
    path.parent.mkdir()
    path.write_bytes(sign_receipt(forged, s["private"]))
    res = _verify_cli(s, str(path))
    line = next(x for x in res.stdout.splitlines() if "chatcmpl-cut.receipt" in x)
    assert res.exit_code == 0 and line.startswith("OK:"), res.output
    assert f"max_model_len {stated}" in line and "stated, not refuted" in line, line
    res = _verify_cli(s, str(path), "--deployment", str(s["root"] / "deployment.json"))
    assert res.exit_code == 1, res.output


def test_the_verdict_says_the_checkpoint_name_is_taken_as_stated(served) -> None:
    """The checkpoint's name and source are descriptive (its files' hashes are compared): the OK line says the
    name is the node's statement."""
    x = served["exchanges"]["completion"]
    r = _signed(served, x.receipts)[0].receipt
    res = _verify_cli(served, str(x.receipts[0]))
    line = next(o for o in res.stdout.splitlines() if o.startswith("OK:") and "receipt" in o)
    name = r.deployment_facts["checkpoint"]["name"]
    assert res.exit_code == 0 and f"checkpoint name {name!r} is as the node states it" in line, res.output


def test_the_request_the_proof_the_fingerprint_and_the_text_are_checked(served, tmp_path) -> None:
    """Another request body, text, logprob, receipt proof, deployment, or the receipt of another request:
    each FAILs naming what differs (the CLI's exit 1 too)."""
    x = served["exchanges"]["completion"]
    request, response = x.request, x.response
    choice = response["choices"][0]
    cases = {
        "another request": ({**request, "temperature": 0.5}, response, "another request body"),
        "another text": (request, {**response, "choices": [{**choice, "text": "x"}]}, "text received"),
        "another receipt's proof": (
            request,
            {**response, "receipt": {**response["receipt"], "digest": "0" * 64}},
            "receipt.digest",
        ),
        "another deployment": (request, {**response, "system_fingerprint": "1" * 64}, "system_fingerprint"),
        "another finish": (
            request,
            {**response, "choices": [{**choice, "finish_reason": "stop"}]},
            "finish_reason",
        ),
        "a stop reason": (
            request,
            {**response, "choices": [{**choice, "stop_reason": "Berlin"}]},
            "stop_reason",
        ),
    }
    for what, (req, resp, fragment) in cases.items():
        problems = _problems(served, "completion", resp, req)
        assert any(fragment in p for p in problems), (what, problems)
    other = served["exchanges"]["chat"]
    code, out = _cli(served, tmp_path, request, response, other.receipts)
    assert code == 1 and "another request body" in out, out
