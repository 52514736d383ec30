"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health.

Life of a request: (1) the body is parsed and checked (protocol.py; 400/404 with an OpenAI error body);
(2) it is submitted to the `AsyncEngine` (503 when the queue is full or the engine is closing); (3) the
tokens come back (streamed as SSE chunks as steps produce them, or all at once); (4) the node signs the
receipt and writes it durably; (5) only then does the response, or a stream's final chunk, leave. So a crash
loses no receipt of an answered request. The receipt id is the response id: the JSON field `receipt_id`
and the header `X-Detent-Receipt` (a stream sends the header up front, and `receipt_id` in its final chunks,
after the receipt is on disk). Engine failures answer 500 (a stream: an error event). A client that leaves
before its response is complete (a stream closed, a connection dropped while waiting) has its request
aborted, its queue slot and KV blocks freed, and no receipt: receipts are of completed responses only (a
stream's header announced the id, which then names no receipt). Bodies are read up to `MAX_BODY_BYTES`
(413 beyond), and text that cannot fit in the context is refused before it is tokenized. The app owns the
engine and the node: its shutdown stops the engine and closes the node (the run manifest).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from detent_audit.server.async_engine import (
    AsyncEngine,
    EngineClosed,
    EngineFailed,
    EngineUnavailable,
    QueueFull,
    RequestHandle,
)
from detent_audit.server.node import ServingNode
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
MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) while it is read
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
    raise exc


def _error(exc: BaseException) -> Response:
    status, body = error_status(exc)
    return _json(body, status, {"Retry-After": "1"} if status == 503 else None)


def create_app(engine: AsyncEngine, node: ServingNode, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`, signing with `node` (module docstring)."""
    limits = Limits.of(model_name, engine.max_model_len, engine.vocab_size, engine.tokenizer)
    fmt = TokenFormatter(engine.tokenizer)
    started = int(time.time())

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
        stats = engine.stats()
        if not engine.is_alive:
            return _json({"status": "unavailable", **stats}, 503)
        return _json({"status": "ok", **stats})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                                  "owned_by": "detent-audit", "max_model_len": limits.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    async def serve(request: Request, chat: bool) -> Response:
        try:
            raw = await _bounded_body(request)
            try:
                body = json.loads(raw, object_pairs_hook=unique_keys)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
            # tokenizing (and the chat template) off the event loop: a long prompt must not stall other requests
            req = await run_in_threadpool(parse_request, body, chat, limits, engine.tokenizer)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            handle = engine.submit(req.prompt_ids, req.params, rid)
        except (BadInput, EngineUnavailable) as exc:
            return _error(exc)
        try:
            if req.stream:
                await handle.admitted()  # a request the scheduler refuses still gets a 400, not a broken stream
                return StreamingResponse(stream(req, handle, rid), media_type="text/event-stream",
                                         headers={RECEIPT_HEADER: rid, "Cache-Control": "no-cache"})
            out = await _result_unless_gone(request, handle)
        except (BadInput, EngineUnavailable, EngineFailed) as exc:
            return _error(exc)
        except BaseException:
            handle.cancel()
            raise
        signed = await run_in_threadpool(node.sign, out, req.params, rid)  # (4): durable before answering
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
            choice["logprobs"] = (chat_logprobs(fmt, out.token_ids, out.logprobs, _tops(out, req), req.tokens_as_ids)
                                  if req.logprobs else None)
        else:
            choice["text"] = out.text
            choice["logprobs"] = (completion_logprobs(fmt, out.token_ids, out.logprobs, _tops(out, req),
                                                      TextStream(engine.tokenizer).offsets(out.token_ids),
                                                      req.tokens_as_ids) if req.logprobs else None)
        return _json({**head(rid, chat, chunk=False, created=int(time.time())), "choices": [choice],
                      "usage": usage(len(out.prompt_token_ids), len(out.token_ids)),
                      "receipt_id": signed.receipt_id, "seed": req.params.seed},
                     headers={RECEIPT_HEADER: signed.receipt_id})

    def head(rid: str, chat: bool, chunk: bool, created: int) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model_name,
                "system_fingerprint": node.facts_hash}

    async def stream(req: ParsedRequest, handle: RequestHandle, rid: str) -> AsyncIterator[str]:
        text, created = TextStream(engine.tokenizer), int(time.time())

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
            signed = await run_in_threadpool(node.sign, out, req.params, rid)  # (4): before the final chunk
            yield chunk(text.flush(), None, out.finish_reason, receipt_id=signed.receipt_id, seed=req.params.seed)
            if req.include_usage:
                yield _sse({**head(rid, req.chat, chunk=True, created=created), "choices": [],
                            "usage": usage(len(out.prompt_token_ids), len(out.token_ids)),
                            "receipt_id": signed.receipt_id})
            yield "data: [DONE]\n\n"
        except (BadInput, EngineUnavailable, EngineFailed) as exc:
            yield _sse(error_status(exc)[1])
            yield "data: [DONE]\n\n"
        finally:
            handle.cancel()  # a no-op once finished; else the client left and the output is discarded

    return app


async def _bounded_body(request: Request) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `MAX_BODY_BYTES`: from its Content-Length
    before reading, or while it streams in, so memory stays bounded whatever the client sends."""
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
        chunks.append(chunk)
    return b"".join(chunks)


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


def _tops(out: Any, req: ParsedRequest) -> list[list[tuple[int, float]]]:
    """Per output token, the top-n alternatives (empty lists when the request asked for none)."""
    if req.params.logprobs and len(out.top_logprobs) == len(out.token_ids):
        return out.top_logprobs
    return [[] for _ in out.token_ids]
