"""A client's check of one answer: its request, the response it received and the node's receipts, against each
other, then the receipts' bits (`detent-audit verify-response`, or `verify_response` in one call).

First each receipt's steps (1)-(3) (read, signature by a trusted key, payload); then the request: each receipt
binds this exact body (its canonical JSON's SHA-256, `receipt.body_json`) as a request to the endpoint the
client called (`request.client.api`); then the response, as the client's OpenAI SDK shows it
(`response_view.py`): its id is the receipts' request ids, the proof it carries (`receipt`: digest, keyid,
signature) is the receipt's, its `system_fingerprint` the receipt's deployment, its `model` the one the
request named, its `usage` the receipt's token counts, and each choice (one per prompt: choice i is the
receipt of prompt i) holds the receipt's text, finish reason and, per output position, the token string,
logprob bits and the top alternatives in order; last, `verify` of the receipts, steps (1)-(10). Any difference
between request, response and receipt is a FAIL that names the field; a malformed document is bad input.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests import decoding as dec
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import Envelope, read_envelope_bytes
from detent_audit.manifests.encoding import JsonValue
from detent_audit.manifests.receipt import Receipt, body_json, verify_envelope
from detent_audit.verifier.expected_response import (
    Expected,
    first_difference,
    legacy_pairs,
    model_tokenizer,
    no_tokenizer,
)
from detent_audit.verifier.report import Outcome, Report
from detent_audit.verifier.response_view import (
    API_OF,
    CHAT,
    COMPLETIONS,
    OBJECT_OF,
    ResponseView,
    response_view,
)
from detent_audit.verifier.verify import verify

if TYPE_CHECKING:
    from detent_audit.runtime.tokenizer import Tokenizer

MAX_DOCUMENT_BYTES = 256 << 20
ENDPOINTS = tuple(API_OF)


def read_json_document(path: str | Path, what: str) -> JsonValue:
    """A JSON object (a request or a response), or a response saved as a server-sent-event stream (the list of
    its chunks). Raises `BadInput` for anything else."""
    try:
        text = dec.read_bounded(path, MAX_DOCUMENT_BYTES, what=what).decode("utf-8")
    except DetentError as exc:
        raise BadInput(exc.message) from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: the {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        if text.lstrip().startswith("data:"):
            return [json.loads(line[5:]) for line in text.splitlines()
                    if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadInput(f"{path}: the {what} is not JSON ({str(exc)[:200]})") from None
    if not isinstance(document, dict):
        raise BadInput(f"{path}: the {what} is a JSON {type(document).__name__}, not an object",
                       remedy="pass the body as sent or received (a stream: its server-sent events, as "
                              "received)")
    return document


class Signed(NamedTuple):
    """A receipt whose signature verified, and its envelope (the proof a response carries is over it)."""

    receipt: Receipt
    envelope: Envelope


class ResponseCheck(NamedTuple):
    """`problems`: each difference, naming its field (empty: none); `notes`: what the response states that no
    receipt binds."""

    problems: list[str]
    notes: list[str]


def endpoint_of(request: Mapping[str, object], endpoint: str | None) -> str:
    """The endpoint the client called: as given, else the one its body is a request to (the two take disjoint
    bodies: `messages` only chat, `prompt` only completions)."""
    if endpoint is not None:
        if endpoint not in API_OF:
            raise BadInput(f"unknown endpoint {endpoint!r}", remedy=f"use one of {', '.join(ENDPOINTS)}")
        return endpoint
    if "messages" in request and "prompt" not in request:
        return CHAT
    if "prompt" in request and "messages" not in request:
        return COMPLETIONS
    raise BadInput("the request has neither 'messages' nor 'prompt': which endpoint it went to is not known",
                   remedy=f"pass --endpoint ({', '.join(ENDPOINTS)})")


def _prompts(request: Mapping[str, object], endpoint: str) -> tuple[list[str | None], bool]:
    """Per choice, the text of its prompt as the client gave it (None: token ids), and whether the response
    has several choices, each with its own receipt named `<id>-<index>`: a batch (a /v1/completions prompt
    that is a list of prompts), or `n` > 1 choices per prompt (choice i answers prompt i // n)."""
    prompt = request.get("prompt") if endpoint == COMPLETIONS else None
    n = request.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return [p if isinstance(p, str) else None for p in prompt for _ in range(n)], True
    return [prompt if isinstance(prompt, str) else None] * n, n > 1


def check_response(request: object, response: object, signed: Sequence[Signed], *,
                   endpoint: str | None = None,
                   tokenizer: Callable[[], Tokenizer] | None = None) -> ResponseCheck:
    """The differences between what the client sent and received and what the receipts (one per prompt) bind.
    `endpoint`: the one the client called (None: from its body); `tokenizer`: gives the deployment's tokenizer
    (token strings and offsets are checked with it). Raises `BadInput` for a malformed request or response."""
    if not isinstance(request, dict):
        raise BadInput(f"the request must be the JSON object the client sent, got {type(request).__name__}")
    endpoint = endpoint_of(request, endpoint)
    body_sha = enc.sha256_hex(body_json(request))
    view = response_view(response, endpoint)
    problems, notes = list(view.problems), list[str]()
    prompts, batched = _prompts(request, endpoint)
    rid = view.one("id")
    if not isinstance(rid, str):
        raise BadInput(f"the response's id must be a string, got {type(rid).__name__}")
    # the receipts: each of this body, as a request to this endpoint, one per prompt
    by_index: dict[int, Signed] = {}
    for item in signed:
        r = item.receipt
        name = r.request.request_id
        if r.request.client.api != API_OF[endpoint]:
            problems.append(f"receipt {name}: the node signed the request as one to {r.request.client.api}; "
                            f"the client called {endpoint}")
        if r.request.client.body_sha256 != body_sha:
            problems.append(f"receipt {name}: it binds another request body than this one (SHA-256 of its "
                            f"canonical JSON {body_sha[:16]}..., the receipt's "
                            f"{r.request.client.body_sha256[:16]}...)")
        index = int(name.rsplit("-", 1)[1]) if batched and name.rsplit("-", 1)[-1].isdigit() else 0
        if name != (f"{rid}-{index}" if batched else rid):
            problems.append(f"response.id {rid!r} is not the id of receipt {name!r}"
                            + (" (choice i of a batch is '<id>-i')" if batched else ""))
        if index in by_index or index >= len(prompts):
            raise BadInput(f"receipt {name}: names no choice of the request, or one another receipt names",
                           remedy=f"give one receipt per choice ({len(prompts)})")
        by_index[index] = item
    if len(by_index) != len(prompts):
        raise BadInput(f"the request has {len(prompts)} choice(s) and {len(by_index)} receipt(s) were given",
                       remedy="give the receipt of every choice of the request (the response's receipt_ids)")
    receipts = [by_index[i].receipt for i in range(len(prompts))]
    problems += _check_head(view, request, endpoint, batched, [by_index[i] for i in range(len(prompts))],
                            notes)
    # the choices: choice i holds receipt i's answer
    for index in sorted(set(view.choices) - set(by_index)):
        problems.append(f"choices[{index}]: the request has {len(prompts)} choice(s), so no choice {index}: "
                        "text there is text no receipt holds")
    expected = Expected(tokenizer or no_tokenizer)
    echo = endpoint == COMPLETIONS and request.get("echo") is True
    as_ids = request.get("return_tokens_as_token_ids") is True
    for index, r in enumerate(receipts):
        got = view.choices.get(index)
        where = f"choices[{index}]"
        if got is None:
            problems.append(f"{where}: missing (the receipt {r.request.request_id} answers it)")
            continue
        if echo and r.scoring is None:
            problems.append(f"{where}: an echo answered under a receipt that scores no prompt")
            continue
        prompt_text = expected.prompt_text(r, prompts[index]) if echo else ""
        if got.text != prompt_text + r.output.text:
            problems.append(f"{where}: the text received is not the text the receipt holds"
                            + (" (after the echoed prompt)" if echo else ""))
        if got.finish_reason != r.output.finish_reason:
            problems.append(f"{where}.finish_reason {got.finish_reason!r}, the receipt's is "
                            f"{r.output.finish_reason!r}")
        if got.stop_reason is not None and got.stop_reason != expected.stop_reason(r):
            problems.append(f"{where}.stop_reason {got.stop_reason!r} is not what stopped the receipt's "
                            "output")
        if got.receipt_id is not None and got.receipt_id != r.request.request_id:
            problems.append(f"{where}.receipt_id {got.receipt_id!r} is not the receipt's "
                            f"{r.request.request_id!r}")
        if batched:
            problems += _proof_problems(got.proof, by_index[index], f"{where}.receipt")
        elif got.proof is not None:
            problems.append(f"{where}.receipt: a proof the server sends beside the choices, not in them")
        want = expected.logprobs(r, endpoint, echo, prompt_text, as_ids)
        if want is None and got.logprobs:
            problems.append(f"{where}.logprobs: returned for a request that asked for none")
        elif want is not None:
            if endpoint == COMPLETIONS:
                want, have = legacy_pairs(want), legacy_pairs(got.logprobs)
            else:
                have = got.logprobs
            block = f"{where}.logprobs" + (".content" if endpoint == CHAT else "")
            difference = first_difference(want, have, block)
            if difference is not None:
                problems.append(f"the logprobs received are not the receipt's: {difference}")
    return ResponseCheck(problems, notes)


def _check_head(view: ResponseView, request: Mapping[str, object], endpoint: str, batched: bool,
                signed: list[Signed], notes: list[str]) -> list[str]:
    """The response's own fields: object, fingerprint, model, seed, usage, receipt ids and proof."""
    problems, receipts = [], [s.receipt for s in signed]
    first = receipts[0]
    obj = view.one("object")
    if obj is not None and obj != OBJECT_OF[(endpoint, view.stream)]:
        problems.append(f"response.object {obj!r} is not a {endpoint} response "
                        f"({OBJECT_OF[(endpoint, view.stream)]!r})")
    fingerprint = view.one("system_fingerprint")
    if any(fingerprint != r.deployment_hash for r in receipts):
        problems.append(f"response.system_fingerprint {str(fingerprint)[:16]}... is not the receipt's "
                        f"deployment {first.deployment_hash[:16]}...")
    model, asked = view.one("model"), request.get("model")
    if isinstance(asked, str):
        if model != asked:
            problems.append(f"response.model {str(model)[:80]!r} is not the model the request named "
                            f"({asked[:80]!r})")
    elif model is not None:
        notes.append(f"the response's model {str(model)[:80]!r} is the node's word (the request named none)")
    seed = view.one("seed")  # the request's: choice 0's (choice i of n is seeded apart: manifests/seeds.py)
    if seed is not None and seed != first.request.seed:
        problems.append(f"response.seed {seed!r} is not the receipt's seed")
    prompt_tokens = sum(len(r.request.prompt_token_ids) for r in receipts)
    completion_tokens = sum(len(r.output.token_ids) for r in receipts)
    want_usage: dict[str, int] | None = {"prompt_tokens": prompt_tokens,
                                         "completion_tokens": completion_tokens,
                                         "total_tokens": prompt_tokens + completion_tokens}
    options = request.get("stream_options")
    if view.stream and not (isinstance(options, dict) and options.get("include_usage") is True):
        want_usage = None
    got_usage = view.one("usage")
    if want_usage is None and got_usage is not None:
        problems.append("response.usage: sent for a stream that asked for none")
    elif want_usage is not None:
        difference = first_difference(want_usage, got_usage, "response.usage")
        if difference is not None:
            problems.append(f"the usage billed is not the receipts' token counts: {difference}")
    ids = [r.request.request_id for r in receipts]
    if batched:
        got_ids = view.one("receipt_ids")
        if got_ids is not None and got_ids != ids:
            problems.append(f"response.receipt_ids {str(got_ids)[:200]} are not the receipts' {ids}")
        for name in ("receipt", "receipt_id"):
            if view.one(name) is not None:
                problems.append(f"response.{name}: a batch's receipts are named in its choices")
        return problems
    if view.one("receipt_ids") is not None:
        problems.append("response.receipt_ids: a response of one prompt names its receipt in receipt_id")
    got_id = view.one("receipt_id")
    if got_id is not None and got_id != ids[0]:
        problems.append(f"response.receipt_id {got_id!r} is not the receipt's {ids[0]!r}")
    return problems + _proof_problems(view.one("receipt"), signed[0], "response.receipt")


def _proof_problems(proof: object, signed: Signed, where: str) -> list[str]:
    """The proof a response carries (digest, keyid, signature) must be this receipt's."""
    if not isinstance(proof, dict):
        return [f"the response carries no receipt proof ({where})"]
    problems = []
    if proof.get("digest") != signed.receipt.digest:
        problems.append(f"{where}.digest {str(proof.get('digest'))[:16]}... is not this receipt's "
                        f"({signed.receipt.digest[:16]}...)")
    if proof.get("signature") != base64.b64encode(signed.envelope.signature).decode("ascii"):
        problems.append(f"{where}.signature is not this receipt's signature")
    if proof.get("keyid") != signed.envelope.keyid:
        problems.append(f"{where}.keyid is not this receipt's signer")
    return problems


def verify_response(request: object, response: object, receipt_paths: str | Path | Sequence[str | Path],
                    trusted: dict, *, endpoint: str | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    **verify_options: Any) -> Report:
    """A client's whole check in one call: request, response and receipts (one per prompt of the request)
    against each other, then `verify` of the receipts (`verify_options`: model, mode, deployments, ...).
    `endpoint`: the one the client called (None: from the request's body). The report's first outcome is the
    response's; a malformed document makes it BAD and nothing else is run."""
    if isinstance(receipt_paths, (str, Path)):
        receipt_paths = [receipt_paths]
    paths = [Path(p) for p in receipt_paths]
    label = ", ".join(map(str, paths))
    try:
        if not paths:
            raise BadInput("no receipt given", remedy="pass the receipt of every prompt of the request")
        signed = []
        for path in paths:
            data = read_envelope_bytes(path)
            signed.append(Signed(verify_envelope(data, trusted).receipt, Envelope.from_bytes(data)))
        tokenizer = model_tokenizer(verify_options.get("model"), verify_options.get("cache_dir"))
        check = check_response(request, response, signed, endpoint=endpoint, tokenizer=tokenizer)
    except DetentError as exc:
        status = "FAIL" if exc.exit_code == 1 else "BAD"
        mode = verify_options.get("mode", "rescore")
        return Report([Outcome(label, "response", status, exc.message)], mode)
    report = verify(paths, trusted, progress=progress, **verify_options)
    rids = ", ".join(s.receipt.request.request_id for s in signed)
    if check.problems:
        outcome = Outcome(label, "response", "FAIL", "; ".join(check.problems), rids)
    else:
        digests = ", ".join(f"{s.receipt.digest[:16]}..." for s in signed)
        message = f"request, response and {len(signed)} receipt(s) agree ({digests}; request {rids})"
        outcome = Outcome(label, "response", "OK", "; ".join([message, *check.notes]), rids)
    report.outcomes.insert(0, outcome)
    return report
