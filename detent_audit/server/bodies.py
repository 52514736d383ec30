"""Reading request bodies in bounded memory and time, whatever the clients send together.

Each body is refused as soon as it is known to exceed `MAX_BODY_BYTES` (413: from its Content-Length, or
while it streams in). All bodies being read or parsed at once share `MAX_INFLIGHT_BODY_BYTES` (503 beyond);
a body past its first `SMALL_BODY_BYTES` cannot take the last `RESERVED_BODY_BYTES` of it, so large uploads,
even stalled ones, never keep requests of ordinary size from being read. A body must arrive within
`BODY_READ_TIMEOUT_S` seconds, with no gap longer than `BODY_IDLE_TIMEOUT_S` (408 otherwise): a client that
stops sending gives its share back instead of holding it for as long as its connection stays open.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from detent_audit.server.async_engine import EngineUnavailable
from detent_audit.server.protocol import InvalidRequest

MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) while it is read
MAX_INFLIGHT_BODY_BYTES = 256 << 20  # all bodies being read or parsed at once (then 503, Retry-After)
SMALL_BODY_BYTES = 1 << 20  # bodies up to this size may use the reserve
BODY_READ_TIMEOUT_S = 120.0  # the whole body
BODY_IDLE_TIMEOUT_S = 15.0  # between two chunks of it


class BodyBudget:
    """The bytes held by all request bodies being read or parsed, against `limit`; the last `reserve` bytes
    are kept for small bodies (module docstring). `take` raises `EngineUnavailable` (503) when it is spent."""

    def __init__(self, limit: int, reserve: int) -> None:
        self.limit, self.reserve, self.used = limit, reserve, 0

    def take(self, n: int, held: int) -> None:
        """Take `n` more bytes for a body that holds `held` already."""
        small = held + n <= 2 * SMALL_BODY_BYTES  # a body is held twice: its chunks and the joined bytes
        cap = self.limit if small else self.limit - self.reserve
        if self.used + n > cap:
            raise EngineUnavailable(f"the server is reading {self.used} bytes of request bodies already (at "
                                    f"most {cap} at once for a body of this size); retry")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


def body_budget() -> BodyBudget:
    """The server's budget, from the module's limits (read when the app is made)."""
    return BodyBudget(MAX_INFLIGHT_BODY_BYTES, MAX_INFLIGHT_BODY_BYTES // 8)


async def read_body(request: Request, budget: BodyBudget, held: list[int]) -> bytes:
    """The body of `request`, read as the module docstring says; every chunk is taken from `budget` first,
    `held[0]` the bytes taken (the caller gives them back once the body and what was parsed from it are
    gone). Raises `InvalidRequest` (413, 408) or `EngineUnavailable` (503)."""
    too_large = InvalidRequest(f"the request body is larger than {MAX_BODY_BYTES} bytes",
                               code="body_too_large", status=413)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    deadline = time.monotonic() + BODY_READ_TIMEOUT_S
    stream = request.stream().__aiter__()
    while True:
        wait = min(BODY_IDLE_TIMEOUT_S, deadline - time.monotonic())
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout=max(wait, 0.0))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise InvalidRequest(f"the request body did not arrive in time (at most {BODY_READ_TIMEOUT_S:g} "
                                 f"s in all, {BODY_IDLE_TIMEOUT_S:g} s without data)", code="request_timeout",
                                 status=408) from None
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        budget.take(2 * len(chunk), held[0])  # the chunk, and its share of the joined body
        held[0] += 2 * len(chunk)
        chunks.append(chunk)
    return b"".join(chunks)
