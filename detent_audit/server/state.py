"""What every route of the HTTP server shares (`ServerState`, on `app.state.detent`) and its JSON replies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from detent_audit.errors import BadInput
from detent_audit.server.async_engine import AsyncEngine, EngineFailed, EngineUnavailable, QueueFull
from detent_audit.server.bodies import BodyBudget
from detent_audit.server.metrics import Metrics
from detent_audit.server.node import ServingNode, StorageFailed
from detent_audit.server.protocol import InvalidRequest, Limits
from detent_audit.server.responses import TokenFormatter, error_body


@dataclass
class ServerState:
    """The engine and node the app serves, what requests are checked against, and the counters."""

    engine: AsyncEngine
    node: ServingNode
    model_name: str
    limits: Limits
    fmt: TokenFormatter
    started: int              # unix seconds, /v1/models' `created`
    budget: BodyBudget
    metrics: Metrics


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.detent
    return state


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, allow_nan=False), status_code=status, headers=headers,
                    media_type="application/json")


def error_status(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of an exception a request ended with (others are re-raised)."""
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
        return 507, error_body(f"the response's receipt could not be stored: {exc.message}", "server_error",
                               None, "insufficient_storage")
    raise exc


def error_response(exc: BaseException) -> Response:
    status, body = error_status(exc)
    return json_response(body, status, {"Retry-After": "1"} if status in (503, 507) else None)
