"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, and beside them
/health, /version, /metrics (Prometheus text), /tokenize, /detokenize and /tokenizer_info (vLLM's shapes).

Life of a request (completions.py): (1) the body is read (bodies.py: bounded in size, in time and by a
server-wide budget; 413, 408, 503) and checked (protocol.py; 400/404 with an OpenAI error body), off the event
loop; (2) it is submitted to the `AsyncEngine` (503 when the queue is full or the engine is closing); (3) the
tokens come back (streamed as SSE chunks as steps produce them, or all at once); (4) the node signs the
receipt and writes it durably; (5) only then does the response, or a stream's final chunk, leave. So a crash
loses no receipt of an answered request. The receipt id is the response id: the JSON field `receipt_id`
and the header `X-Detent-Receipt` (a stream sends the header up front, and `receipt_id` in its final chunks,
after the receipt is on disk). Every response carries the client's proof, `receipt` = {id, digest, keyid,
signature} (the receipt's SHA-256 and the base64 Ed25519 signature over it; headers `X-Detent-Receipt-Digest`
and `-Signature` on non-streamed responses, the final chunk's `receipt` on streams), and the receipt binds the
request body as the client sent it (its canonical JSON), so `detent-audit verify-response` can check all
three against each other. `system_fingerprint` and /v1/models carry the deployment hash.

A receipt that cannot be written (a full disk) withholds the response: 507 with an OpenAI error body (a
stream: an error event, then `[DONE]`), and /health reports `storage_failed`; each later request (and /health)
tries a write again, so the server recovers once space is freed. Engine failures answer 500 (a stream: an
error event). A client that leaves before its response is complete has its request aborted, its queue slot
and KV blocks freed, and no receipt: receipts are of completed responses only.

With `api_key`, every /v1/ route needs `Authorization: Bearer <api_key>` (401 otherwise, as vLLM's
`--api-key`); the others stay open. The app owns the engine and the node: its shutdown stops the engine and
closes the node (the run manifest).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from detent_audit.server import completions, tokenizer_routes
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.bodies import body_budget
from detent_audit.server.metrics import CONTENT_TYPE, Metrics
from detent_audit.server.node import ServingNode
from detent_audit.server.protocol import Limits
from detent_audit.server.responses import TokenFormatter, error_body
from detent_audit.server.state import ServerState, json_response, state_of

DEPLOYMENT_HEADER = "X-Detent-Deployment"
ROUTES: list[tuple[str, str, Callable[[Request], Awaitable[Response]]]] = []  # (method, path, route)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def route(method: str, path: str) -> Callable[[Callable[[Request], Awaitable[Response]]],
                                              Callable[[Request], Awaitable[Response]]]:
    """Registers a module-level route function (taking the request, reading `state_of(request)`)."""
    def register(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        ROUTES.append((method, path, fn))
        return fn

    return register


def create_app(engine: AsyncEngine, node: ServingNode, model_name: str, *,
               api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`, signing with `node` (module docstring)."""
    state = ServerState(engine, node, model_name,
                        Limits.of(model_name, engine.max_model_len, engine.vocab_size, engine.tokenizer),
                        TokenFormatter(engine.tokenizer), int(time.time()), body_budget(), Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn has finished or cancelled every response by now: nothing waits on the engine any more
        await run_in_threadpool(engine.shutdown, drain=False)
        await run_in_threadpool(node.close)

    app = FastAPI(title="detent-audit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.detent = state
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    for method, path, fn in ROUTES:
        app.add_api_route(path, fn, methods=[method])
    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)
    app.add_middleware(_Counted, metrics=state.metrics, paths={path for _, path, _ in ROUTES})  # outermost
    return app


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return json_response(error_body(str(exc.detail), "invalid_request_error"), exc.status_code)


class _BearerAuth:
    """/v1/ routes answer 401 unless the request carries `Authorization: Bearer <api_key>` (compared in
    constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body("a valid API key is needed: send 'Authorization: Bearer <key>'",
                                  "authentication_error", None, "invalid_api_key")
                await json_response(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Counted:
    """Counts every HTTP response by route and status (unknown paths as "other") for /metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: set[str]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


@route("GET", "/health")
async def health(request: Request) -> Response:
    state = state_of(request)
    stats = {**state.engine.stats(), "deployment_hash": state.node.facts_hash,
             "request_body_bytes": state.budget.used}
    if not state.engine.is_alive:
        return json_response({"status": "unavailable", **stats}, 503)
    if not await run_in_threadpool(state.node.storage_ok):  # no receipt can be written: no response given
        return json_response({"status": "storage_failed", "error": state.node.storage_error, **stats}, 503)
    return json_response({"status": "ok", **stats})


@route("GET", "/v1/models")
async def models(request: Request) -> Response:
    state = state_of(request)
    model = {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "detent-audit",
             "max_model_len": state.limits.max_model_len, "deployment_hash": state.node.facts_hash}
    return json_response({"object": "list", "data": [model]},
                         headers={DEPLOYMENT_HEADER: state.node.facts_hash})


@route("GET", "/version")
async def version(request: Request) -> Response:
    from detent_audit import __version__

    return json_response({"version": __version__})


@route("GET", "/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    text = state.metrics.exposition(state.engine.num_outstanding, state.budget.used)
    return Response(text, media_type=CONTENT_TYPE)


route("POST", "/v1/completions")(completions.completions)
route("POST", "/v1/chat/completions")(completions.chat_completions)
route("POST", "/tokenize")(tokenizer_routes.tokenize)
route("POST", "/detokenize")(tokenizer_routes.detokenize)
route("GET", "/tokenizer_info")(tokenizer_routes.tokenizer_info)
