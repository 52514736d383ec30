"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health.

Life of a request: (1) the body is parsed and checked (protocol.py; 400/404 with an OpenAI error body);
(2) it is submitted to the `AsyncEngine` (503 when the queue is full or the engine is closing); (3) the
tokens come back (streamed as SSE chunks as steps produce them, or all at once); (4) the node signs the
receipt and writes it durably; (5) only then does the response, or a stream's final chunk, leave. So a crash
loses no receipt of an answered request. The receipt id is the response id: the JSON field `receipt_id`
and the header `X-Detent-Receipt` (a stream sends the header up front, and `receipt_id` in its final chunks,
after the receipt is on disk). Every response carries the client's proof, `receipt` = {id, digest, keyid,
signature} (the receipt's SHA-256 and the base64 Ed25519 signature over it; headers `X-Detent-Receipt-Digest`
and `-Signature` on non-streamed responses, the final chunk's `receipt` on streams), and the receipt binds the
request body as the client sent it (its canonical JSON), so `detent-audit verify-response` can check all
three against each other. `system_fingerprint` and /v1/models carry the deployment hash. A receipt that
cannot be written (a full disk) withholds the response: 507 with an OpenAI error body (a stream: an error
event, then `[DONE]`), and /health reports `storage_failed`. Bodies are read against a server-wide budget
(`MAX_INFLIGHT_BODY_BYTES`, 503 beyond) and parsed off the event loop. Engine failures answer 500 (a stream: an error event). A client that leaves
before its response is complete (a stream closed, a connection dropped while waiting) has its request
aborted, its queue slot and KV blocks freed, and no receipt: receipts are of completed responses only (a
stream's header announced the id, which then names no receipt). Bodies are read up to `MAX_BODY_BYTES`
(413 beyond), and text that cannot fit in the context is refused before it is tokenized. The app owns the
engine and the node: its shutdown stops the engine and closes the node (the run manifest).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from detent_audit.errors import BadInput
from detent_audit.manifests.receipt import MAX_CLIENT_BODY, ClientRequest
from detent_audit.runtime.stop_strings import find_stop
from detent_audit.server.async_engine import (
    AsyncEngine,
    EngineClosed,
    EngineFailed,
    EngineUnavailable,
    QueueFull,
    RequestHandle,
)
from detent_audit.server.node import ServingNode, SignedReceipt, StorageFailed
from detent_audit.server.protocol import InvalidRequest, Limits, ParsedRequest, parse_request, unique_keys
from detent_audit.server.responses import (
    TextStream,
    TokenFormatter,
    chat_logprobs,
    completion_logprobs,
    error_body,
    usage,
)

RECEIPT_HEADER = "X-Detent-Receipt"
DIGEST_HEADER = "X-Detent-Receipt-Digest"
SIGNATURE_HEADER = "X-Detent-Receipt-Signature"
DEPLOYMENT_HEADER = "X-Detent-Deployment"
MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) while it is read
MAX_INFLIGHT_BODY_BYTES = 256 << 20  # all bodies being read or parsed at once (then 503, Retry-After)
APIS = {False: "openai/v1/completions", True: "openai/v1/chat/completions"}
DISCONNECT_POLL_S = 0.25    # how often a non-streamed request checks that its client is still there


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, allow_nan=False), status_code=status, headers=headers,
                    media_type="application/json")


def _sse(body: Any) -> str:
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def error_status(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of an exception a request ended with."""
    if isinstance(exc, InvalidRequest):
        return exc.status, error_body(exc.message, "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, BadInput):
        message = exc.message + (f" (remedy: {exc.remedy})" if exc.remedy else "")
        return 400, error_body(message, "invalid_request_error", None, "invalid_value")
    if isinstance(exc, EngineUnavailable):
        code = "queue_full" if isinstance(exc, QueueFull) else "unavailable"
        return 503, error_body(str(exc), "service_unavailable_error", None, code)
    if isinstance(exc, EngineFailed):
        return 500, error_body(str(exc), "server_error", None, "engine_failed")
    if isinstance(exc, StorageFailed):  # the receipt could not be written: the response is withheld
        return 507, error_body(f"the response's receipt could not be stored: {exc.message}", "server_error", None,
                               "insufficient_storage")
    raise exc


def _error(exc: BaseException) -> Response:
    status, body = error_status(exc)
    return _json(body, status, {"Retry-After": "1"} if status in (503, 507) else None)


class _BodyBudget:
    """The bytes of all request bodies being read or parsed at once, against `MAX_INFLIGHT_BODY_BYTES`: a
    body that would pass it is refused (503) as it is read, so many large bodies together cannot exhaust
    memory (each one's own limit is `MAX_BODY_BYTES`)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise EngineUnavailable(f"the server is reading {self.used} bytes of request bodies already (at most "
                                    f"{self.limit} at once); retry")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


def receipt_headers(signed: SignedReceipt) -> dict[str, str]:
    proof = signed.client_proof
    return {RECEIPT_HEADER: signed.receipt_id, DIGEST_HEADER: proof["digest"], SIGNATURE_HEADER: proof["signature"]}


def create_app(engine: AsyncEngine, node: ServingNode, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`, signing with `node` (module docstring)."""
    limits = Limits.of(model_name, engine.max_model_len, engine.vocab_size, engine.tokenizer)
    fmt = TokenFormatter(engine.tokenizer)
    started = int(time.time())
    budget = _BodyBudget(MAX_INFLIGHT_BODY_BYTES)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has finished or cancelled every response by now: nothing waits on the engine any more
        await run_in_threadpool(engine.shutdown, drain=False)
        await run_in_threadpool(node.close)

    app = FastAPI(title="detent-audit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _json(error_body(str(exc.detail), "invalid_request_error"), exc.status_code)

    @app.get("/health")
    async def health() -> Response:
        stats = {**engine.stats(), "deployment_hash": node.facts_hash}
        if not engine.is_alive:
            return _json({"status": "unavailable", **stats}, 503)
        if node.storage_error is not None:  # receipts cannot be written: no response can be given
            return _json({"status": "storage_failed", "error": node.storage_error, **stats}, 503)
        return _json({"status": "ok", **stats})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                                  "owned_by": "detent-audit", "max_model_len": limits.max_model_len,
                                                  "deployment_hash": node.facts_hash}]},
                     headers={DEPLOYMENT_HEADER: node.facts_hash})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    async def serve(request: Request, chat: bool) -> Response:
        try:
            held = [0]
            try:
                raw = await _bounded_body(request, budget, held)
                # JSON, the client binding and tokenizing (and the chat template) off the event loop: a large
                # body must not stall other requests or /health
                body = await run_in_threadpool(_parse_body, raw)
                del raw
                req = await run_in_threadpool(parse_request, body, chat, limits, engine.tokenizer)
                client = await run_in_threadpool(_bind, body, chat)
                del body  # what stays is the prompt's ids (bounded by the context) and the canonical body
            finally:
                budget.give(held[0])  # held while the body and its parsed objects are alive
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if node.storage_error is not None:  # its receipt could not be written: refuse before computing
                raise StorageFailed(node.storage_error)
            # a batch: one engine request (and one receipt) per prompt, named <id>-<index>
            rids = [f"{rid}-{i}" for i in range(len(req.prompts))] if req.batched else [rid]
            handles: list[RequestHandle] = []
            try:
                for prompt_ids, one_rid in zip(req.prompts, rids):
                    handles.append(engine.submit(prompt_ids, req.params, one_rid, score_prompt=req.echo))
            except EngineUnavailable:
                for handle in handles:
                    handle.cancel()
                raise
        except (BadInput, EngineUnavailable, StorageFailed) as exc:
            return _error(exc)
        try:
            if req.stream:
                handle = handles[0]
                await handle.admitted()  # a request the scheduler refuses still gets a 400, not a broken stream
                return StreamingResponse(stream(req, handle, rid, client), media_type="text/event-stream",
                                         headers={RECEIPT_HEADER: rid, "Cache-Control": "no-cache"})
            outs = [await _result_unless_gone(request, handle) for handle in handles]
        except (BadInput, EngineUnavailable, EngineFailed) as exc:
            for handle in handles:  # the response fails whole: no prompt of it is answered, none signed
                handle.cancel()
            return _error(exc)
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        choices, signed_all, prompt_tokens, completion_tokens = [], [], 0, 0
        for index, (out, one_rid) in enumerate(zip(outs, rids)):
            if req.max_tokens == 0:  # echo only: the token the engine drew is neither returned nor signed
                out = dataclasses.replace(out, token_ids=[], logprobs=[], top_logprobs=[], text="",
                                          finish_reason="length")
            try:  # (4): durable before answering
                signed = await run_in_threadpool(node.sign, out, req.params, one_rid, client, max_tokens=req.max_tokens)
            except StorageFailed as exc:
                return _error(exc)
            signed_all.append(signed)
            prompt_tokens, completion_tokens = prompt_tokens + len(out.prompt_token_ids), completion_tokens + len(out.token_ids)
            choices.append(choice_body(req, out, index, signed))
        body = {**head(rid, chat, chunk=False, created=int(time.time())), "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens), "seed": req.params.seed}
        if req.batched:  # each choice carries its own receipt id and proof
            body["receipt_ids"] = [s.receipt_id for s in signed_all]
            return _json(body, headers={RECEIPT_HEADER: ",".join(s.receipt_id for s in signed_all)})
        body.update(receipt_id=signed_all[0].receipt_id, receipt=signed_all[0].client_proof)
        return _json(body, headers=receipt_headers(signed_all[0]))

    def choice_body(req: ParsedRequest, out: Any, index: int, signed: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason,
                                  "stop_reason": _stop_reason(out, req, engine.tokenizer.decode)}
        if req.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
            choice["logprobs"] = (chat_logprobs(fmt, out.token_ids, out.logprobs, _tops(out, req), req.tokens_as_ids)
                                  if req.logprobs else None)
        elif not req.echo:
            choice["text"] = out.text
            choice["logprobs"] = (completion_logprobs(fmt, out.token_ids, out.logprobs, _tops(out, req),
                                                      TextStream(engine.tokenizer).offsets(out.token_ids),
                                                      req.tokens_as_ids) if req.logprobs else None)
        else:  # echo: the prompt first, its first token without a logprob (nothing precedes it), as vLLM does
            text = req.prompt_texts[index]
            prompt_text = engine.tokenizer.decode(out.prompt_token_ids) if text is None else text
            choice["text"] = prompt_text + out.text
            if req.logprobs:
                ids = [*out.prompt_token_ids, *out.token_ids]
                prompt_tops = out.prompt_top_logprobs if req.params.logprobs else [[] for _ in out.prompt_logprobs]
                block = completion_logprobs(fmt, ids[1:], [*out.prompt_logprobs, *out.logprobs],
                                            [*prompt_tops, *_tops(out, req)], [], req.tokens_as_ids)
                first = fmt.text(ids[0], req.tokens_as_ids)
                offsets = TextStream(engine.tokenizer).offsets(out.prompt_token_ids)
                offsets += [len(prompt_text) + o for o in TextStream(engine.tokenizer).offsets(out.token_ids)]
                choice["logprobs"] = {"tokens": [first, *block["tokens"]],
                                      "token_logprobs": [None, *block["token_logprobs"]],
                                      "top_logprobs": [None, *block["top_logprobs"]], "text_offset": offsets}
            else:
                choice["logprobs"] = None
        choice["receipt_id"] = signed.receipt_id
        if req.batched:
            choice["receipt"] = signed.client_proof
        return choice

    def head(rid: str, chat: bool, chunk: bool, created: int) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model_name,
                "system_fingerprint": node.facts_hash}

    async def stream(req: ParsedRequest, handle: RequestHandle, rid: str, client: ClientRequest
                     ) -> AsyncIterator[str]:
        text, created = TextStream(engine.tokenizer, req.params.stop), int(time.time())

        def chunk(piece: str, logprobs: Any, finish: str | None, **extra: Any) -> str:
            choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
            if req.chat:
                choice["delta"] = {"content": piece} if piece or finish is None else {}
            else:
                choice["text"] = piece
            return _sse({**head(rid, req.chat, chunk=True, created=created), "choices": [choice], **extra})

        try:
            if req.chat:
                yield _sse({**head(rid, True, chunk=True, created=created),
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
            async for delta in handle.stream():
                logprobs = None
                tops = delta.top if req.params.logprobs else [[] for _ in delta.token_ids]
                if req.logprobs and req.chat:
                    logprobs = chat_logprobs(fmt, delta.token_ids, delta.logprobs, tops, req.tokens_as_ids)
                elif req.logprobs:
                    logprobs = completion_logprobs(fmt, delta.token_ids, delta.logprobs, tops,
                                                   text.offsets(delta.token_ids), req.tokens_as_ids)
                yield chunk(text.push(delta.token_ids), logprobs, None)
            out = await handle.result()
            signed = await run_in_threadpool(node.sign, out, req.params, rid, client)  # (4): before the last chunk
            proof = signed.client_proof
            yield chunk(text.flush(), None, out.finish_reason, receipt_id=signed.receipt_id, seed=req.params.seed,
                        receipt=proof)
            if req.include_usage:
                yield _sse({**head(rid, req.chat, chunk=True, created=created), "choices": [],
                            "usage": usage(len(out.prompt_token_ids), len(out.token_ids)),
                            "receipt_id": signed.receipt_id, "receipt": proof})
            yield "data: [DONE]\n\n"
        except (BadInput, EngineUnavailable, EngineFailed, StorageFailed) as exc:
            yield _sse(error_status(exc)[1])
            yield "data: [DONE]\n\n"
        finally:
            handle.cancel()  # a no-op once finished; else the client left and the output is discarded

    return app


async def _bounded_body(request: Request, budget: _BodyBudget, held: list[int]) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `MAX_BODY_BYTES`: from its Content-Length
    before reading, or while it streams in; every chunk is taken from the server-wide `budget` first (503
    when it is spent), `held[0]` the bytes taken (the caller gives them back). So memory stays bounded
    whatever the clients send, together."""
    too_large = InvalidRequest(f"the request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large",
                               status=413)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        budget.take(2 * len(chunk))  # the chunk, and its share of the joined body
        held[0] += 2 * len(chunk)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_body(raw: bytes) -> Any:
    """The JSON body (off the event loop)."""
    try:
        return json.loads(raw, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _bind(body: Any, chat: bool) -> ClientRequest:
    """The client binding a receipt carries: the checked body's canonical JSON (413 when too large to carry)."""
    try:
        return ClientRequest.of(APIS[chat], body)
    except BadInput as exc:  # a body parse_request accepted is JSON: only its size can fail here
        raise InvalidRequest(f"the request body cannot be bound into a receipt: {exc.message} (at most "
                             f"{MAX_CLIENT_BODY} bytes of canonical JSON)", code="body_too_large", status=413) from None


async def _result_unless_gone(request: Request, handle: RequestHandle) -> Any:
    """The handle's output; if the client disconnects first, the request is aborted (its slot and KV blocks
    freed) and ends with `EngineClosed`, so no receipt is signed for a response nobody received."""
    result = asyncio.ensure_future(handle.result())
    try:
        while True:
            done, _ = await asyncio.wait({result}, timeout=DISCONNECT_POLL_S)
            if done:
                return result.result()
            if await request.is_disconnected():
                handle.cancel()
                with contextlib.suppress(Exception):  # ended by the abort, or finished in the step under way
                    await result
                raise EngineClosed("the client disconnected before its response was complete")
    finally:
        if not result.done():
            result.cancel()


def _stop_reason(out: Any, req: ParsedRequest, decode: Any) -> str | int | None:
    """What stopped the output, as vLLM reports it: the stop string its text contained, a stop token id, or
    None (EOS or length)."""
    if out.finish_reason != "stop" or not out.token_ids:
        return None
    if out.token_ids[-1] in req.params.stop_token_ids:
        return out.token_ids[-1]
    hit = find_stop(decode(out.token_ids), req.params.stop) if req.params.stop else None
    return None if hit is None else hit.stop


def _tops(out: Any, req: ParsedRequest) -> list[list[tuple[int, float]]]:
    """Per output token, the top-n alternatives (empty lists when the request asked for none)."""
    if req.params.logprobs and len(out.top_logprobs) == len(out.token_ids):
        return out.top_logprobs
    return [[] for _ in out.token_ids]
