"""A client's check of one answer: its request, the response it received and the node's receipt, against each
other, then the receipt's bits (`detent-audit verify-response`, or `verify_response` in one call).

First the receipt's steps (1)-(3) (read, signature by a trusted key, payload); then the request: the receipt
binds this exact body (its canonical JSON's SHA-256, `receipt.body_json`) at this endpoint; then the
response: its id is the receipt's request id, the proof it carries (`receipt`: digest, keyid, signature) is
this receipt's, its `system_fingerprint` the receipt's deployment, its text, finish reason, per-token logprobs
(fp32 bits) and top alternatives those the receipt holds; last, `verify` of the receipt, steps (1)-(10). Any
difference between request, response and receipt is a FAIL that names the field.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests import decoding as dec
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import Envelope, read_envelope_bytes
from detent_audit.manifests.receipt import Receipt, body_json, verify_envelope
from detent_audit.verifier.report import Outcome, Report
from detent_audit.verifier.verify import verify

MAX_DOCUMENT_BYTES = 256 << 20


def read_json_document(path: str | Path, what: str) -> Any:
    """A JSON file (a request or a response), or a response saved as a server-sent-event stream."""
    try:
        data = dec.read_bounded(path, MAX_DOCUMENT_BYTES, what=what)
    except DetentError as exc:
        raise BadInput(exc.message) from None
    text = data.decode("utf-8", "replace")
    try:
        if text.lstrip().startswith("data:"):
            return [json.loads(line[5:]) for line in text.splitlines()
                    if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadInput(f"{path}: the {what} is not JSON ({str(exc)[:200]})") from None


def _f32(value: Any) -> bytes | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return struct.pack("<f", value)


def response_view(response: Any) -> dict[str, Any]:
    """What a response (a completion body, or the chunks of a stream) told the client: id, fingerprint, text,
    finish reason, proof, per-token logprobs and top alternatives' logprobs."""
    chunks = response if isinstance(response, list) else [response]
    if not chunks or not all(isinstance(c, dict) for c in chunks):
        raise BadInput("the response must be a JSON object (or the chunks of a stream)")
    view: dict[str, Any] = {"id": chunks[0].get("id"), "fingerprint": chunks[0].get("system_fingerprint"),
                            "text": "", "finish_reason": None, "proof": None, "logprobs": [], "tops": []}
    for c in chunks:
        if isinstance(c.get("receipt"), dict):
            view["proof"] = c["receipt"]
        for choice in c.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            piece = choice.get("text") if "text" in choice else delta.get("content") if isinstance(delta, dict) else None
            view["text"] += piece or ""
            view["finish_reason"] = choice.get("finish_reason") or view["finish_reason"]
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):  # chat
                for entry in lp["content"]:
                    view["logprobs"].append(entry.get("logprob"))
                    view["tops"].append(sorted(t.get("logprob") for t in entry.get("top_logprobs") or []))
            elif isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):  # legacy completions
                view["logprobs"] += lp["token_logprobs"]
                view["tops"] += [sorted((t or {}).values()) for t in lp.get("top_logprobs") or []]
    return view


def check_response(request: Any, response: Any, receipt: Receipt, envelope: Envelope) -> list[str]:
    """The differences between what the client sent and received and what the receipt binds (empty: none)."""
    problems = []
    if not isinstance(request, dict):
        return ["the request must be the JSON object the client sent"]
    try:
        body = body_json(request)
    except DetentError as exc:
        return [exc.message]
    if enc.sha256_hex(body) != receipt.request.client.body_sha256:
        problems.append("request: the receipt binds another request body than this one (SHA-256 of its canonical "
                        f"JSON {enc.sha256_hex(body)[:16]}..., the receipt's {receipt.request.client.body_sha256[:16]}...)")
    view = response_view(response)
    if view["id"] != receipt.request.request_id:
        problems.append(f"response.id {view['id']!r} is not the receipt's request {receipt.request.request_id!r}")
    proof = view["proof"]
    if not isinstance(proof, dict):
        problems.append("the response carries no receipt proof (its 'receipt' field)")
    else:
        if proof.get("digest") != receipt.digest:
            problems.append(f"response.receipt.digest {str(proof.get('digest'))[:16]}... is not this receipt's "
                            f"({receipt.digest[:16]}...)")
        if proof.get("signature") != base64.b64encode(envelope.signature).decode("ascii"):
            problems.append("response.receipt.signature is not this receipt's signature")
        if proof.get("keyid") != envelope.keyid:
            problems.append("response.receipt.keyid is not this receipt's signer")
    if view["fingerprint"] != receipt.deployment_hash:
        problems.append(f"response.system_fingerprint {str(view['fingerprint'])[:16]}... is not the receipt's "
                        f"deployment {receipt.deployment_hash[:16]}...")
    chunks = response if isinstance(response, list) else [response]
    seed = next((c["seed"] for c in reversed(chunks) if isinstance(c, dict) and "seed" in c), None)
    if seed is not None and seed != receipt.request.seed:  # the seed the node drew, as it told the client
        problems.append(f"response.seed {seed!r} is not the receipt's seed")
    if view["text"] != receipt.output.text:
        problems.append("the text received is not the text the receipt holds")
    if view["finish_reason"] != receipt.output.finish_reason:
        problems.append(f"finish_reason {view['finish_reason']!r}, the receipt's is {receipt.output.finish_reason!r}")
    if view["logprobs"]:
        got = [_f32(v) for v in view["logprobs"]]
        want = [struct.pack("<f", v) for v in receipt.output.logprobs]
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            problems.append(f"the logprobs received differ from the receipt's at output position {first} "
                            f"({len(got)} received, {len(want)} in the receipt)")
        tops_got = [{_f32(v) for v in t} for t in view["tops"]]
        # every value received is one of the receipt's alternatives there (the legacy block adds the sampled
        # token, and keys by token text, so two tokens of one text show once)
        tops_want = [{struct.pack("<f", v) for _, v in t} | {lp} for t, lp in zip(receipt.output.top_logprobs, want)]
        if len(tops_got) != len(tops_want) or any(not g <= w for g, w in zip(tops_got, tops_want)) \
                or any(len(g) < min(receipt.output.top_k, 1) for g in tops_got):
            problems.append("the top logprobs received are not the alternatives the receipt holds")
    return problems


def verify_response(request: Any, response: Any, receipt_path: str | Path, trusted: dict, *,
                    progress: Callable[[int, int], None] | None = None, **verify_options: Any) -> Report:
    """A client's whole check in one call: request, response and receipt against each other, then `verify`
    of the receipt (`verify_options`: model, mode, deployments, ...). The report's first outcome is the
    response's."""
    path = Path(receipt_path)
    try:
        data = read_envelope_bytes(path)
        receipt = verify_envelope(data, trusted).receipt
        problems = check_response(request, response, receipt, Envelope.from_bytes(data))
    except DetentError as exc:
        return Report([Outcome(str(path), "response", "FAIL" if exc.exit_code == 1 else "BAD", exc.message)], "none")
    report = verify([path], trusted, progress=progress, **verify_options)
    status = "FAIL" if problems else "OK"
    message = "; ".join(problems) if problems else (f"request, response and receipt {receipt.digest[:16]}... agree "
                                                    f"(request {receipt.request.request_id})")
    report.outcomes.insert(0, Outcome(str(path), "response", status, message, receipt.request.request_id))
    return report
