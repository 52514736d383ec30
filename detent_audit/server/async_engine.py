"""`AsyncEngine`: an engine (the contract's `Engine`) behind a thread, for the HTTP server's event loop.

One background thread owns the LLM (which is not thread-safe: nothing else touches it). Requests arrive
through a lock-guarded inbox; the thread admits them (`LLM.add_request`), loops `step()` while there is
work and sleeps when there is none. After each step it publishes each live request's new tokens (ids, fp32
logprobs, top-n alternatives) as a `TokenDelta`, and each finished request's `RequestOutput`.

Invariants:
- At most `max_queued` requests are outstanding (accepted and not yet finished or failed); `submit` beyond
  that raises `QueueFull` at once, it never blocks.
- Every accepted request ends exactly once: with its `RequestOutput`, or with an exception (`BadInput` when
  the scheduler refuses it, at admission or later: the engine's `output_of` raises a `DetentError` for that
  request alone; `EngineClosed` when cancelled by shutdown, `EngineFailed` when a step raised).
  A step that raises fails every outstanding request and stops the engine: the LLM's state is then unknown.
- A cancelled handle (client gone) is aborted before the next step: its KV blocks and its queue slot are
  freed at once, and it ends with `EngineClosed` (so it never reaches signing: no receipt).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from detent_audit.errors import BadInput, DetentError
from detent_audit.runtime.contract import Engine, RequestOutput
from detent_audit.runtime.contract import RequestHandle as EngineRequest
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.threads import set_threads


class EngineUnavailable(Exception):
    """The engine takes no request now (the server answers 503)."""


class QueueFull(EngineUnavailable):
    """`max_queued` requests are outstanding already."""


class EngineClosed(EngineUnavailable):
    """The engine is shutting down or has stopped."""


class EngineFailed(RuntimeError):
    """A step raised; the request was failed (the server answers 500). The cause is chained."""


@dataclass(frozen=True)
class TokenDelta:
    """New output tokens of one request since the previous delta (all lists the same length; `top` is
    empty per token when the request asked for no alternatives)."""

    token_ids: list[int]
    logprobs: list[float]                         # fp32 values
    top: list[list[tuple[int, float]]]            # per token: (token id, fp32 logprob), most likely first


@dataclass(frozen=True)
class _Finished:
    output: RequestOutput


@dataclass(frozen=True)
class _Failed:
    error: BaseException


async def _shielded(future: concurrent.futures.Future) -> Any:
    """Await the engine's `future` without letting a cancelled waiter cancel it. Its outcome is marked as
    retrieved even when no waiter is left (a client gone), so nothing logs an unretrieved exception."""
    wrapped = asyncio.wrap_future(future)
    wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())
    return await asyncio.shield(wrapped)


class RequestHandle:
    """One submitted request. Await `admitted()` (the scheduler took it), iterate `stream()` (deltas in
    order), await `result()` (the final output). Created by `AsyncEngine.submit` only."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop | None, score_prompt: bool = False) -> None:
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.score_prompt = score_prompt  # echo: the prompt's logprobs (and top-n) come with the output
        self.admitted_future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.future: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
        self.cancelled = False
        self._loop = loop
        self._events: asyncio.Queue[TokenDelta | _Finished | _Failed] = asyncio.Queue()

    async def admitted(self) -> None:
        """Return once the engine accepted the request; raises what refused it (e.g. `BadInput`). Cancelling
        the waiter leaves the engine's future alone (shielded): only the engine ends a request."""
        await _shielded(self.admitted_future)

    async def result(self) -> RequestOutput:
        return await _shielded(self.future)

    async def stream(self) -> AsyncIterator[TokenDelta]:
        """Every delta in order, then return; raises the request's error instead of ending normally."""
        if self._loop is None:
            raise RuntimeError("stream() needs the handle to be submitted from a running event loop")
        while True:
            event = await self._events.get()
            if isinstance(event, TokenDelta):
                yield event
            elif isinstance(event, _Failed):
                raise event.error
            else:
                return

    def cancel(self) -> None:
        """The caller no longer wants the result: the engine aborts the request before its next step."""
        self.cancelled = True

    # ---- engine side (the engine thread only)
    def _post(self, event: TokenDelta | _Finished | _Failed) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def _finish(self, output: RequestOutput) -> None:
        self._post(_Finished(output))
        self.future.set_result(output)

    def _fail(self, error: BaseException) -> None:
        if self.future.done():
            return
        if not self.admitted_future.done():
            self.admitted_future.set_exception(error)
        self._post(_Failed(error))
        self.future.set_exception(error)


class AsyncEngine:
    """Serves an engine (`detent_audit.runtime.contract.Engine`) from one background thread (started here).
    See the module docstring."""

    def __init__(self, llm: Engine, *, max_queued: int = 256) -> None:
        if max_queued < 1:
            raise BadInput(f"max_queued must be >= 1, got {max_queued}")
        self.llm, self.max_queued = llm, max_queued
        # read-only facts the server checks requests against (safe to read from any thread)
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.vocab_size
        self._cv = threading.Condition()
        self._inbox: deque[RequestHandle] = deque()
        self._outstanding = 0
        self._closed = False            # no new requests
        self._cancel = False            # fail what is left instead of draining it
        self.error: BaseException | None = None
        self._admitting: list[RequestHandle] = []  # taken from the inbox, being added to the LLM
        self._live: dict[int, tuple[EngineRequest, RequestHandle]] = {}  # seq_id -> (sequence, handle)
        self._emitted: dict[int, int] = {}  # seq_id -> output tokens published
        self._thread = threading.Thread(target=self._run, name="detent-engine", daemon=True)
        self._thread.start()

    @property
    def num_outstanding(self) -> int:
        with self._cv:
            return self._outstanding

    @property
    def is_alive(self) -> bool:
        """True while the engine accepts requests."""
        with self._cv:
            return not self._closed and self.error is None

    def stats(self) -> dict[str, Any]:
        """Outstanding requests, the bound, whether the engine closed (and why); for an engine that counts
        them, its steps by how many sequences shared each (`{"3": 12}`: 12 steps ran 3 sequences together)."""
        sizes = getattr(self.llm, "step_batch_sizes", None)
        with self._cv:
            stats: dict[str, Any] = {"outstanding": self._outstanding, "max_queued": self.max_queued,
                                     "closed": self._closed,
                                     "error": None if self.error is None else repr(self.error)}
        if sizes is not None:  # written by the engine thread only; a copy of a dict of ints is safe to take
            stats["step_batch_sizes"] = {str(n): c for n, c in sorted(dict(sizes).items())}
        return stats

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, *,
               score_prompt: bool = False) -> RequestHandle:
        """Queue one request; raises `QueueFull` or `EngineClosed` at once. Call from the event loop that
        will consume the handle's stream (or from plain code, then only `future` is usable). `score_prompt`:
        the output carries the prompt's logprobs (and `params.logprobs` alternatives each)."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        handle = RequestHandle(request_id, list(prompt_ids), params, loop, score_prompt)
        with self._cv:
            if self._closed or self.error is not None:
                raise EngineClosed("the engine is shutting down" if self.error is None else
                                   f"the engine stopped after an error: {self.error!r}")
            if self._outstanding >= self.max_queued:
                raise QueueFull(f"{self._outstanding} requests are queued or running "
                                f"(at most {self.max_queued})")
            self._outstanding += 1
            self._inbox.append(handle)
            self._cv.notify()
        return handle

    def shutdown(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests, then end the thread. drain=True: every accepted request runs to its end
        (after `timeout` seconds, what is left is cancelled); drain=False: requests not finished are failed
        with `EngineClosed` after the current step. Idempotent; returns when the thread has stopped."""
        with self._cv:
            self._closed = True
            self._cancel = self._cancel or not drain
            self._cv.notify()
        self._thread.join(timeout if drain else None)
        if self._thread.is_alive():
            with self._cv:
                self._cancel = True
                self._cv.notify()
            self._thread.join()

    # ---- the engine thread
    def _run(self) -> None:
        set_threads(self.llm.num_threads)  # the count the deployment facts record
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._live and not self._closed:
                        self._cv.wait()
                    if self._cancel or (self._closed and not self._inbox and not self._live):
                        break
                    self._admitting = list(self._inbox)
                    self._inbox.clear()
                for handle in self._admitting:
                    self._admit(handle)
                self._admitting = []
                if self._live:
                    self._step()
        except BaseException as exc:  # every request must end, whatever the step raised
            failure = EngineFailed(f"the engine failed: {exc!r}")
            failure.__cause__ = exc
            with self._cv:
                self.error = exc
            self._fail_all(failure)
            return
        self._fail_all(EngineClosed("the server shut down before this request finished"))

    def _admit(self, handle: RequestHandle) -> None:
        if handle.cancelled:
            self._end(handle, None)
            return
        try:
            seq = self.llm.add_request(handle.prompt_ids, handle.params, request_id=handle.request_id,
                                       score_prompt=handle.score_prompt)
        except Exception as exc:  # BadInput: the scheduler refused it (too long for the KV cache)
            self._end(handle, exc)
            return
        self._live[seq.seq_id] = (seq, handle)
        self._emitted[seq.seq_id] = 0
        handle.admitted_future.set_result(None)

    def _step(self) -> None:
        for seq_id, (seq, handle) in list(self._live.items()):
            if handle.cancelled:  # the client left: free its blocks and its slot before computing for it
                self.llm.abort(seq)
                del self._live[seq_id], self._emitted[seq_id]
                self._end(handle, EngineClosed("the request was cancelled"))
        if not self._live:
            return
        finished = self.llm.step()
        for seq_id, (seq, handle) in self._live.items():
            done = self._emitted[seq_id]
            if seq.num_output_tokens > done:
                self._emitted[seq_id] = seq.num_output_tokens
                if not handle.cancelled:
                    top = self.llm.top_logprobs_so_far(seq)[done:] if handle.params.logprobs else []
                    handle._post(TokenDelta(seq.output_token_ids[done:], seq.output_logprobs[done:],
                                            top or [[] for _ in range(seq.num_output_tokens - done)]))
        for seq in finished:
            _, handle = self._live.pop(seq.seq_id)
            del self._emitted[seq.seq_id]
            try:
                output = self.llm.output_of(seq)  # also hands over (drops) the LLM's per-seq top logprobs
            except DetentError as exc:  # the engine refused this request after admitting it: it alone fails
                self._end(handle, exc)
                continue
            self._end(handle, None, output)

    def _end(self, handle: RequestHandle, error: BaseException | None,
             output: RequestOutput | None = None) -> None:
        if handle.future.done():  # ended already (a handle can be both admitting and live when a step fails)
            return
        with self._cv:
            self._outstanding -= 1
        if output is not None:
            handle._finish(output)
        else:
            handle._fail(error or EngineClosed("the request was cancelled"))

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            left = list(self._inbox)
            self._inbox.clear()
            self._closed = True
        left += [handle for handle in self._admitting if not handle.future.done()]
        left += [handle for _, handle in self._live.values() if not handle.future.done()]
        self._admitting = []
        self._live.clear()
        self._emitted.clear()
        for handle in left:
            self._end(handle, error)
