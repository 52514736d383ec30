"""`AsyncEngine`: streamed deltas add up to the final output, bit for bit what the offline engine gives;
a bounded queue; shutdown by draining or cancelling; refusals and engine failures end requests, never hang."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import TYPE_CHECKING

import pytest
import torch

from detent_audit.engine.llm import LLM
from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.server.async_engine import AsyncEngine, EngineClosed, EngineFailed, QueueFull

if TYPE_CHECKING:
    from conftest import Env


def _bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


def _gate(llm: LLM) -> threading.Event:
    """Block the engine thread before each step until the returned event is set."""
    gate, original = threading.Event(), llm.step

    def gated() -> list:
        gate.wait(30)
        return original()

    llm.step = gated
    return gate


def test_streamed_deltas_equal_the_final_output_and_the_offline_engine(env: Env) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.9]), top_p=rng.choice([1.0, 0.8]), seed=i,
                             max_tokens=rng.randint(1, 12), ignore_eos=True, logprobs=rng.choice([None, 2]))
              for i in range(12)]
    engine = AsyncEngine(LLM(env.engine_config()))

    async def run_one(i: int) -> tuple:
        handle = engine.submit(prompts[i], params[i], f"r{i}")
        deltas = [d async for d in handle.stream()]
        return deltas, await handle.result()

    async def run_all() -> list:
        return await asyncio.gather(*(run_one(i) for i in range(12)))

    try:
        results = asyncio.run(run_all())
    finally:
        engine.shutdown()
    alone = LLM(env.engine_config()).generate(prompts, params)
    for (deltas, out), ref, p in zip(results, alone, params):
        assert [t for d in deltas for t in d.token_ids] == out.token_ids == ref.token_ids
        assert torch.equal(_bits([v for d in deltas for v in d.logprobs]), _bits(ref.logprobs))
        assert torch.equal(_bits(out.logprobs), _bits(ref.logprobs))
        tops = [t for d in deltas for t in d.top]
        assert tops == (out.top_logprobs if p.logprobs else [[] for _ in out.token_ids])
    assert engine.num_outstanding == 0


def test_a_full_queue_raises_at_once(env: Env) -> None:
    llm = LLM(env.engine_config())
    gate = _gate(llm)
    engine = AsyncEngine(llm, max_queued=2)
    try:
        first = [engine.submit([1, 2, 3], SamplingParams(max_tokens=2), f"q{i}") for i in range(2)]
        with pytest.raises(QueueFull, match="at most 2"):
            engine.submit([1, 2, 3], SamplingParams(max_tokens=2), "q2")
        gate.set()
        assert all(len(h.future.result(30).token_ids) <= 2 for h in first)
        assert engine.submit([1, 2], SamplingParams(max_tokens=1), "q3").future.result(30).token_ids
    finally:
        gate.set()
        engine.shutdown()


def test_shutdown_drains_or_cancels(env: Env) -> None:
    engine = AsyncEngine(LLM(env.engine_config()))
    drained = [engine.submit([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), f"d{i}")
               for i in range(3)]
    engine.shutdown(drain=True)
    assert [len(h.future.result(0).token_ids) for h in drained] == [20, 20, 20]
    with pytest.raises(EngineClosed):
        engine.submit([1], SamplingParams(), "late")

    llm = LLM(env.engine_config())
    gate = _gate(llm)
    engine = AsyncEngine(llm)
    cancelled = [engine.submit([5, 6, 7], SamplingParams(max_tokens=20), f"c{i}") for i in range(3)]
    threading.Timer(0.2, gate.set).start()  # the step under way ends, then the rest is failed
    engine.shutdown(drain=False)
    for h in cancelled:
        with pytest.raises(EngineClosed):
            h.future.result(0)
    assert engine.num_outstanding == 0 and not engine.is_alive


def test_a_refused_request_fails_alone(env: Env) -> None:
    # 64 tokens of KV in a context of 2048: the request fits the context, not the pool
    engine = AsyncEngine(LLM(env.engine_config(num_kv_blocks=4, block_size=16)))
    try:
        too_long = engine.submit(list(range(1, 60)), SamplingParams(max_tokens=30), "long")
        fine = engine.submit([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "short")
        with pytest.raises(BadInput, match="KV blocks"):
            too_long.future.result(30)
        assert len(fine.future.result(30).token_ids) == 4
        assert engine.is_alive
    finally:
        engine.shutdown()


def test_an_engine_exception_fails_every_outstanding_request(env: Env) -> None:
    llm = LLM(env.engine_config())
    gate = threading.Event()

    def broken() -> list:
        gate.wait(30)
        raise RuntimeError("step exploded")

    llm.step = broken
    engine = AsyncEngine(llm)
    handles = [engine.submit([1, 2, 3], SamplingParams(max_tokens=3), f"e{i}") for i in range(4)]
    gate.set()
    for h in handles:
        with pytest.raises(EngineFailed, match="step exploded") as info:
            h.future.result(30)
        assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(EngineClosed, match="stopped after an error"):
        engine.submit([1], SamplingParams(), "after")
    assert engine.num_outstanding == 0 and not engine.is_alive
    engine.shutdown()


def test_cancelled_waiters_never_leak_a_slot_and_an_abandoned_request_is_aborted(env: Env) -> None:
    """A waiter task cancelled (a handler torn down) leaves the engine's futures alone, so the request still
    ends once and frees its slot; a cancelled handle is aborted before the next step, never run to its end."""
    llm = LLM(env.engine_config())
    gate = _gate(llm)
    engine = AsyncEngine(llm, max_queued=2)

    async def main() -> None:
        handles = [engine.submit([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), f"w{i}")
                   for i in range(2)]
        waiters = [asyncio.ensure_future(handles[0].result()), asyncio.ensure_future(handles[1].admitted())]
        await asyncio.sleep(0.05)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert not handles[0].future.cancelled() and not handles[1].admitted_future.cancelled()
        for h in handles:
            h.cancel()  # the clients left
        gate.set()
        for h in handles:
            with pytest.raises(EngineClosed):
                await h.result()

    try:
        asyncio.run(main())
        assert engine.num_outstanding == 0 and engine.is_alive
        assert llm.scheduler.block_manager.stats.num_used_blocks == 0 and not llm.has_unfinished()
        again = engine.submit([1, 2], SamplingParams(max_tokens=1), "after").future.result(30)
        assert len(again.token_ids) == 1
    finally:
        gate.set()
        engine.shutdown()


def test_a_response_finished_as_its_client_left_is_not_answered() -> None:
    """The disconnect noticed while the final step runs: the output that step produced is not handed on to be
    signed (no receipt for a response nobody receives); with the client there, it is."""
    from detent_audit.server.completions import _result_unless_gone

    class Handle:
        def __init__(self) -> None:
            self.cancelled = False

        async def result(self) -> str:
            await asyncio.sleep(0.6)  # the step under way ends after the disconnect is seen
            return "output"

        def cancel(self) -> None:
            self.cancelled = True

    class Request:
        def __init__(self, gone: bool) -> None:
            self.gone = gone

        async def is_disconnected(self) -> bool:
            return self.gone

    async def main() -> None:
        gone = Handle()
        with pytest.raises(EngineClosed, match="disconnected"):
            await _result_unless_gone(Request(True), gone)
        assert gone.cancelled
        stayed = Handle()
        assert await _result_unless_gone(Request(False), stayed) == "output" and not stayed.cancelled

    asyncio.run(main())


def test_stats_count_the_steps_by_the_sequences_that_shared_them(env: Env) -> None:
    """Each request is in exactly two steps (its prefill, then the decode of its second token): with the first
    request held at the gate while two more arrive, the first step runs it alone, the second its decode with
    the others' prefills, the third their decodes."""
    llm = LLM(env.engine_config())
    engine = AsyncEngine(llm)
    gate = _gate(llm)
    try:
        assert engine.stats()["step_batch_sizes"] == {}
        first = engine.submit([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), "s0")
        first.admitted_future.result(30)  # the engine thread now waits at the gate, before its first step
        rest = [engine.submit([4, 5, 6, 7][: i + 2], SamplingParams(max_tokens=2, ignore_eos=True),
                              f"s{i + 1}")
                for i in range(2)]
        gate.set()
        for h in [first, *rest]:
            assert len(h.future.result(60).token_ids) == 2
    finally:
        gate.set()
        engine.shutdown()
    assert engine.stats()["step_batch_sizes"] == {"1": 1, "2": 1, "3": 1}
