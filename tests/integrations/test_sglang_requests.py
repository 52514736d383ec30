"""The SGLang engine's request path without SGLang running: a stand-in for `sglang.Engine` that streams a
request's output as SGLang's tokenizer manager does (each chunk the whole output so far, one token per step,
logprobs and top-n alongside), driven through the HTTP server's `AsyncEngine`: tokens reach a stream while
SGLang still generates; a request SGLang refuses fails alone; a stop string ends generation at its token; a
stopped scheduler fails the engine, not the process (the real SGLang: test_sglang_server.py)."""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.server.async_engine import AsyncEngine, EngineFailed

REFUSE = 7  # a prompt starting with this token is refused in SGLang's scheduler (its abort, status 400)
MESSAGE = "beyond the context detent's selection was solved for"
VOCAB = 512


class StandInSGLang:
    """`sglang.Engine`'s `async_generate` and abort, producing one token per `delay` seconds."""

    def __init__(self, delay: float, seed: int) -> None:
        self.delay, self.rng = delay, random.Random(seed)
        self.generated: dict[str, int] = {}   # rid -> tokens produced so far
        self.aborted: list[str] = []
        self.tokenizer_manager = SimpleNamespace(abort_request=self._abort)

    def _abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def async_generate(self, *, input_ids: list[int], sampling_params: dict, rid: str,
                             top_logprobs_num: int = 0, stream: bool = False, **_: Any) -> Any:
        chunks = self._chunks(input_ids, sampling_params["max_new_tokens"], rid, top_logprobs_num)
        if stream:
            return chunks
        last: dict = {}
        async for chunk in chunks:
            last = chunk
        finish = last["meta_info"]["finish_reason"]
        if finish["type"] == "abort":  # SGLang's non-streamed refusal raises (tokenizer_manager.py)
            raise ValueError(finish["message"])
        return last

    async def _chunks(self, prompt: list[int], n: int, rid: str, top_n: int):
        if prompt[0] == REFUSE:
            yield {"output_ids": [], "meta_info": {"output_token_logprobs": [], "finish_reason": {
                "type": "abort", "message": MESSAGE, "status_code": 400}}}
            return
        ids: list[int] = []      # one list, grown in place, as SGLang's snapshots are
        lps: list[tuple] = []
        tops: list[list[tuple]] = []
        for i in range(n):
            if rid in self.aborted:
                return
            await asyncio.sleep(self.delay)
            token = 100 + i
            lp = -self.rng.random() * 4
            ids.append(token)
            lps.append((lp, token, None))
            tops.append([(lp, token, None), (lp - 1.0, token + 1, None)][:top_n])
            self.generated[rid] = len(ids)
            done = i == n - 1
            yield {"output_ids": ids, "meta_info": {
                "output_token_logprobs": lps, "output_top_logprobs": tops, "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": n} if done else None}}


class Tokens:
    """A tokenizer whose text of a token is its id."""

    eos_token_ids = (0,)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def _engine(sglang: StandInSGLang):
    """An `SglangEngine` over the stand-in (what `__init__` sets, without starting SGLang), and the thread
    of its client loop."""
    from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine

    engine = SglangEngine.__new__(SglangEngine)
    engine.config = SglangConfig(model="unused", mode="stock")
    engine.tokenizer = Tokens()
    engine.model_config = SimpleNamespace(vocab_size=VOCAB)
    engine._max_len, engine._ids, engine._live, engine._stopped = 4096, itertools.count(), {}, None
    engine.selection, engine.engine = None, sglang
    engine._loop = asyncio.new_event_loop()
    thread = threading.Thread(target=engine._loop.run_forever, daemon=True)
    thread.start()
    return engine, thread


@pytest.fixture
def served():
    sglang = StandInSGLang(delay=0.02, seed=random.randrange(1 << 30))
    engine, thread = _engine(sglang)
    server = AsyncEngine(engine)
    yield sglang, engine, server
    server.shutdown(drain=False)
    engine._loop.call_soon_threadsafe(engine._loop.stop)
    thread.join(5)


def test_tokens_reach_the_stream_while_sglang_generates(served) -> None:
    """40 tokens, one each 20 ms: the stream's first delta comes while SGLang has produced fewer than all
    (chunk counts, not time: a loaded machine only delays both), and the deltas add up to the final output,
    logprobs and top-2 included."""
    sglang, engine, server = served
    n = 40

    async def run() -> tuple[list[tuple[int, int]], Any]:
        handle = server.submit([5, 6, 8], SamplingParams(temperature=0.0, max_tokens=n, logprobs=2), "r")
        seen = []
        async for delta in handle.stream():
            seen.append((len(delta.token_ids), sglang.generated["detent-0"]))
            pieces.append(delta)
        return seen, await handle.result()

    pieces: list = []
    seen, out = asyncio.run(run())
    assert len(seen) >= 4, seen               # the output came in several deltas, not at the end
    assert seen[0][1] < n, seen               # the first one before SGLang produced the last token
    assert sum(k for k, _ in seen) == n
    assert [t for d in pieces for t in d.token_ids] == out.token_ids == list(range(100, 100 + n))
    assert [lp for d in pieces for lp in d.logprobs] == out.logprobs
    assert [row for d in pieces for row in d.top] == out.top_logprobs
    assert all(len(row) == 2 for row in out.top_logprobs)


def test_a_request_sglang_refuses_fails_alone_and_the_engine_serves_on(served) -> None:
    """SGLang's scheduler refuses one request (its abort): that request ends with `BadInput` naming SGLang's
    reason (the server's 400), the request beside it and the next one are answered."""
    sglang, engine, server = served

    async def run() -> None:
        refused = server.submit([REFUSE, 1, 2], SamplingParams(temperature=0.0, max_tokens=4), "bad")
        beside = server.submit([5, 6], SamplingParams(temperature=0.0, max_tokens=6), "beside")
        with pytest.raises(BadInput, match=MESSAGE):
            await refused.result()
        assert len((await beside.result()).token_ids) == 6
        after = server.submit([5, 6, 9], SamplingParams(temperature=0.0, max_tokens=3), "after")
        assert (await after.result()).token_ids == [100, 101, 102]

    asyncio.run(run())
    assert server.is_alive


def test_a_stop_string_ends_the_output_at_its_token_and_sglang_stops_generating(served) -> None:
    sglang, engine, server = served

    async def run() -> Any:
        return await server.submit([5], SamplingParams(temperature=0.0, max_tokens=200, stop=("103",)),
                                   "s").result()

    out = asyncio.run(run())
    assert out.token_ids == [100, 101, 102, 103] and out.finish_reason == "stop"
    deadline = time.monotonic() + 5
    while "detent-0" not in sglang.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sglang.aborted == ["detent-0"]
    assert sglang.generated["detent-0"] < 200  # it stopped generating for the request, far before the end


def test_sglangs_sigquit_fails_the_engine_and_not_the_process(served) -> None:
    """SGLang's processes send SIGQUIT to the launcher when one fails; the engine's handler (installed in
    place of SGLang's, which kills the process) makes the next step raise, so every request fails with
    `EngineFailed` (the server's 500) and the process carries on."""
    sglang, engine, server = served

    async def run() -> None:
        handle = server.submit([5], SamplingParams(temperature=0.0, max_tokens=400), "long")
        await handle.admitted()
        engine._scheduler_stopped(signal.SIGQUIT, None)
        with pytest.raises(EngineFailed, match="SGLang's scheduler stopped"):
            await handle.result()

    asyncio.run(run())
    assert not server.is_alive
