"""/v1/completions and /v1/chat/completions: one request from its body to its signed response.

(1) the body is read (bodies.py) and checked (protocol.py), off the event loop; (2) one engine request per
choice (a prompt times `n`, each with its own seed: manifests/seeds.py) is submitted; (3) the tokens come
back, streamed as SSE chunks or all at once; (4) the node signs each receipt and writes it durably; (5) only
then does the response, or a stream's final chunk, leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from detent_audit.errors import BadInput
from detent_audit.manifests.receipt import MAX_CLIENT_BODY, ClientRequest
from detent_audit.runtime.contract import RequestOutput
from detent_audit.server.async_engine import EngineClosed, EngineFailed, EngineUnavailable, RequestHandle
from detent_audit.server.bodies import read_body
from detent_audit.server.node import SignedReceipt, StorageFailed
from detent_audit.server.protocol import InvalidRequest, ParsedRequest, parse_request, unique_keys
from detent_audit.server.responses import (
    TextStream,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    stop_reason,
    usage,
)
from detent_audit.server.state import ServerState, error_response, error_status, json_response, state_of

RECEIPT_HEADER = "X-Detent-Receipt"
DIGEST_HEADER = "X-Detent-Receipt-Digest"
SIGNATURE_HEADER = "X-Detent-Receipt-Signature"
APIS = {False: "openai/v1/completions", True: "openai/v1/chat/completions"}
DISCONNECT_POLL_S = 0.25    # how often a non-streamed request checks that its client is still there


def receipt_headers(signed: SignedReceipt) -> dict[str, str]:
    proof = signed.client_proof
    return {RECEIPT_HEADER: signed.receipt_id, DIGEST_HEADER: proof["digest"],
            SIGNATURE_HEADER: proof["signature"]}


async def completions(request: Request) -> Response:
    return await serve(state_of(request), request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await serve(state_of(request), request, chat=True)


async def serve(state: ServerState, request: Request, chat: bool) -> Response:
    """(1)-(5) of the module docstring; every refusal an OpenAI error body."""
    try:
        req, client = await read_request(state, request, chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        failed = state.node.storage_error is not None  # then a write is tried again, off the event loop
        if failed and not await run_in_threadpool(state.node.storage_ok):  # refused before computing
            raise StorageFailed(state.node.storage_error or "receipts cannot be written")
        # several choices (a batch, or n > 1): one engine request (and one receipt) per choice, named
        # <id>-<index>
        rids = [f"{rid}-{i}" for i in range(req.choices)] if req.multi else [rid]
        handles = submit(state, req, rids)
    except (BadInput, EngineUnavailable, StorageFailed) as exc:
        return error_response(exc)
    try:
        if req.stream:
            for handle in handles:  # a request the scheduler refuses gets a 400, not a broken stream
                await handle.admitted()
            return StreamingResponse(stream(state, req, handles, rid, client), media_type="text/event-stream",
                                     headers={RECEIPT_HEADER: ",".join(rids), "Cache-Control": "no-cache"})
        outs = [await _result_unless_gone(request, handle) for handle in handles]
    except (BadInput, EngineUnavailable, EngineFailed) as exc:
        for handle in handles:  # the response fails whole: no prompt of it is answered, none signed
            handle.cancel()
        return error_response(exc)
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    try:
        return await respond(state, req, outs, rid, rids, client)
    except StorageFailed as exc:
        return error_response(exc)


async def read_request(state: ServerState, request: Request, chat: bool
                       ) -> tuple[ParsedRequest, ClientRequest]:
    """(1): the body read against the budget, then JSON, tokenizing (and the chat template) and the client
    binding off the event loop, so a large body stalls neither other requests nor /health."""
    held = [0]
    try:
        raw = await read_body(request, state.budget, held)
        body = await run_in_threadpool(_parse_body, raw)
        del raw
        req = await run_in_threadpool(parse_request, body, chat, state.limits, state.engine.tokenizer)
        client = await run_in_threadpool(_bind, body, chat)
        # a sampled request without a seed gets one derived from the run and the body, and choice i of a
        # seeded one the client's seed + i (manifests/seeds.py)
        named = body.get("seed") is not None
        seeds = tuple(state.node.seeded(req.params, client, named, j).seed for j in range(req.n))
        req = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=seeds[0]), seeds=seeds)
        return req, client  # what stays is the prompt's ids (bounded by the context) and the canonical body
    finally:
        state.budget.give(held[0])  # held while the body and its parsed objects are alive


def submit(state: ServerState, req: ParsedRequest, rids: list[str]) -> list[RequestHandle]:
    """(2): one engine request per choice; none stays queued when one is refused."""
    handles: list[RequestHandle] = []
    try:
        for index, one_rid in enumerate(rids):
            handles.append(state.engine.submit(req.prompts[index // req.n], req.params_of(index), one_rid,
                                               score_prompt=req.echo))
    except EngineUnavailable:
        for handle in handles:
            handle.cancel()
        raise
    return handles


async def sign(state: ServerState, out: RequestOutput, req: ParsedRequest, rid: str, client: ClientRequest,
               max_tokens: int | None = None, index: int = 0) -> SignedReceipt:
    """(4): the receipt of choice `index` signed and written durably (counted in the metrics); raises
    `StorageFailed`."""
    try:
        signed = await run_in_threadpool(state.node.sign, out, req.params_of(index), rid, client,
                                         max_tokens=max_tokens)
    except StorageFailed:
        state.metrics.storage_error()
        raise
    state.metrics.signed(len(out.prompt_token_ids), len(out.token_ids))
    return signed


async def respond(state: ServerState, req: ParsedRequest, outs: list[RequestOutput], rid: str,
                  rids: list[str], client: ClientRequest) -> Response:
    """(4)-(5) of a non-streamed response: every choice signed, then the body."""
    choices, signed_all, prompt_tokens, completion_tokens = [], [], 0, 0
    for index, (out, one_rid) in enumerate(zip(outs, rids)):
        if req.max_tokens == 0:  # echo only: the token the engine drew is neither returned nor signed
            out = dataclasses.replace(out, token_ids=[], logprobs=[], top_logprobs=[], text="",
                                      finish_reason="length")
        signed = await sign(state, out, req, one_rid, client, max_tokens=req.max_tokens, index=index)
        signed_all.append(signed)
        prompt_tokens += len(out.prompt_token_ids)
        completion_tokens += len(out.token_ids)
        choices.append(choice_body(state, req, out, index, signed))
    body = {**head(state, rid, req.chat, chunk=False, created=int(time.time())), "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens), "seed": req.params.seed}
    if req.multi:  # each choice carries its own receipt id and proof
        body["receipt_ids"] = [s.receipt_id for s in signed_all]
        return json_response(body, headers={RECEIPT_HEADER: ",".join(s.receipt_id for s in signed_all)})
    body.update(receipt_id=signed_all[0].receipt_id, receipt=signed_all[0].client_proof)
    return json_response(body, headers=receipt_headers(signed_all[0]))


def choice_body(state: ServerState, req: ParsedRequest, out: RequestOutput, index: int,
                signed: SignedReceipt) -> dict[str, Any]:
    """One choice of a non-streamed response: its message or text, logprobs, stop reason and receipt id."""
    tokenizer, fmt = state.engine.tokenizer, state.fmt
    choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason,
                              "stop_reason": _stop_reason(out, req, tokenizer.decode)}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": out.text}
        choice["logprobs"] = (chat_logprobs(fmt, out.token_ids, out.logprobs, _tops(out, req),
                                            req.tokens_as_ids) if req.logprobs else None)
    elif not req.echo:
        choice["text"] = out.text
        choice["logprobs"] = (completion_logprobs(fmt, out.token_ids, out.logprobs, _tops(out, req),
                                                  TextStream(tokenizer).offsets(out.token_ids),
                                                  req.tokens_as_ids) if req.logprobs else None)
    else:
        choice["text"], choice["logprobs"] = _echo(state, req, out, index)
    choice["receipt_id"] = signed.receipt_id
    if req.multi:
        choice["receipt"] = signed.client_proof
    return choice


def _echo(state: ServerState, req: ParsedRequest, out: RequestOutput, index: int
          ) -> tuple[str, dict[str, Any] | None]:
    """An echo choice's text and logprobs: the prompt first, its first token without a logprob (nothing
    precedes it), as vLLM does."""
    tokenizer, fmt = state.engine.tokenizer, state.fmt
    text = req.prompt_texts[index // req.n]
    prompt_text = tokenizer.decode(out.prompt_token_ids) if text is None else text
    if not req.logprobs:
        return prompt_text + out.text, None
    prompt_logprobs = out.prompt_logprobs or []
    prompt_tops = (out.prompt_top_logprobs or []) if req.params.logprobs else [[] for _ in prompt_logprobs]
    return prompt_text + out.text, echo_logprobs(fmt, out.prompt_token_ids, out.token_ids, prompt_logprobs,
                                                 out.logprobs, prompt_tops, _tops(out, req), prompt_text,
                                                 req.tokens_as_ids)


def head(state: ServerState, rid: str, chat: bool, chunk: bool, created: int) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": state.model_name,
            "system_fingerprint": state.node.facts_hash}


def _sse(body: Any) -> str:
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


async def stream(state: ServerState, req: ParsedRequest, handles: list[RequestHandle], rid: str,
                 client: ClientRequest) -> AsyncIterator[str]:
    """(3)-(5) of a streamed response: a chunk per step's tokens of each choice (its `index`), each choice's
    receipt signed before its final chunk; a failure is an error event, then `[DONE]`. One choice: the receipt
    is named in the final chunk's head; several (n > 1): in each final chunk's choice, and the usage chunk
    lists them all (`receipt_ids`)."""
    tokenizer, created, fmt = state.engine.tokenizer, int(time.time()), state.fmt
    texts = [TextStream(tokenizer, req.params.stop) for _ in handles]

    def chunk(index: int, piece: str, logprobs: Any, finish: str | None, proof: dict[str, Any] | None = None,
              **extra: Any) -> str:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if req.chat:
            choice["delta"] = {"content": piece} if piece or finish is None else {}
        else:
            choice["text"] = piece
        if proof is not None:
            choice.update(proof)
        return _sse({**head(state, rid, req.chat, chunk=True, created=created), "choices": [choice], **extra})

    try:
        if req.chat:
            yield _sse({**head(state, rid, True, chunk=True, created=created),
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None} for i in range(len(handles))]})
        outs: dict[int, RequestOutput] = {}
        signed_all: dict[int, SignedReceipt] = {}
        async for index, delta in _merged(handles):
            text = texts[index]
            if delta is not None:
                logprobs = None
                tops = delta.top if req.params.logprobs else [[] for _ in delta.token_ids]
                if req.logprobs and req.chat:
                    logprobs = chat_logprobs(fmt, delta.token_ids, delta.logprobs, tops, req.tokens_as_ids)
                elif req.logprobs:
                    logprobs = completion_logprobs(fmt, delta.token_ids, delta.logprobs, tops,
                                                   text.offsets(delta.token_ids), req.tokens_as_ids)
                yield chunk(index, text.push(delta.token_ids), logprobs, None)
                continue
            out = outs[index] = await handles[index].result()
            one_rid = f"{rid}-{index}" if req.multi else rid
            # (4), before the choice's final chunk
            signed = signed_all[index] = await sign(state, out, req, one_rid, client, index=index)
            if req.multi:
                yield chunk(index, text.flush(), None, out.finish_reason, seed=req.params.seed,
                            proof={"receipt_id": signed.receipt_id, "receipt": signed.client_proof})
            else:
                yield chunk(index, text.flush(), None, out.finish_reason, receipt_id=signed.receipt_id,
                            seed=req.params.seed, receipt=signed.client_proof)
        if req.include_usage:
            first = signed_all[0]
            ids: dict[str, Any] = {"receipt_id": first.receipt_id, "receipt": first.client_proof}
            if req.multi:
                ids = {"receipt_ids": [signed_all[i].receipt_id for i in range(len(handles))]}
            yield _sse({**head(state, rid, req.chat, chunk=True, created=created), "choices": [],
                        "usage": usage(sum(len(o.prompt_token_ids) for o in outs.values()),
                                       sum(len(o.token_ids) for o in outs.values())), **ids})
        yield "data: [DONE]\n\n"
    except (BadInput, EngineUnavailable, EngineFailed, StorageFailed) as exc:
        yield _sse(error_status(exc)[1])
        yield "data: [DONE]\n\n"
    finally:
        for handle in handles:
            handle.cancel()  # a no-op once finished; else the client left and the output is discarded


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Any]]:
    """(index, delta) from every handle's stream as the deltas come, then (index, None) when handle `index`
    has finished; an error of any stream is raised here."""
    streams = [handle.stream().__aiter__() for handle in handles]
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f]):
                index = pending.pop(future)
                try:
                    delta = future.result()
                except StopAsyncIteration:
                    yield index, None
                    continue
                yield index, delta
                pending[asyncio.ensure_future(streams[index].__anext__())] = index
    finally:
        for future in pending:
            future.cancel()


def _parse_body(raw: bytes) -> Any:
    """The JSON body (off the event loop)."""
    try:
        return json.loads(raw, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The path of the first string (or key) in `value` that is not valid Unicode text (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else key
            found = _lone_surrogate(key, path) or _lone_surrogate(item, path)
            if found is not None:
                return found
    return None


def _bind(body: Any, chat: bool) -> ClientRequest:
    """The client binding a receipt carries: the checked body's canonical JSON. A string that is not Unicode
    text, in any field, is a 400 naming it; a body too large to carry, 413."""
    bad = _lone_surrogate(body, "")
    if bad is not None:
        raise InvalidRequest(f"'{bad}' is not valid Unicode text (it holds a lone surrogate)", param=bad,
                             code="invalid_type")
    try:
        return ClientRequest.of(APIS[chat], body)
    except BadInput as exc:  # a checked body is JSON of Unicode text: only its size can fail here
        raise InvalidRequest(f"the request body cannot be bound into a receipt: {exc.message} (at most "
                             f"{MAX_CLIENT_BODY} bytes of canonical JSON)", code="body_too_large",
                             status=413) from None


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


def _stop_reason(out: RequestOutput, req: ParsedRequest, decode: Any) -> str | int | None:
    return stop_reason(out.token_ids, out.finish_reason, req.params.stop_token_ids, req.params.stop, decode)


def _tops(out: RequestOutput, req: ParsedRequest) -> list[list[tuple[int, float]]]:
    """Per output token, the top-n alternatives (empty lists when the request asked for none)."""
    if req.params.logprobs and len(out.top_logprobs) == len(out.token_ids):
        return out.top_logprobs
    return [[] for _ in out.token_ids]
