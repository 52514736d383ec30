"""The serving harness on a tiny CPU model: timings, the closed loop's concurrency, open-loop admission, and
batch invariance seen through the harness (detent's outputs bit-identical at concurrency 1 and 4)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' own modules
from serving_harness import RunResult, measure_peak, run_workload, same_outputs, token_space_of  # noqa: E402

from detent_audit.bench.workloads import closed_loop, long_documents, sharegpt_like
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.errors import BadInput


@pytest.fixture(scope="module")
def engines(make_checkpoint, tmp_path_factory) -> dict[str, LLM]:
    cache = tmp_path_factory.mktemp("jit")
    return {mode: LLM(EngineConfig(model=str(make_checkpoint("tiny-llama")), mode=mode, max_num_seqs=8,
                                   max_num_batched_tokens=64, num_kv_blocks=256, max_model_len=256,
                                   cache_dir=str(cache)))
            for mode in ("detent", "stock")}


def _requests(llm: LLM, n: int = 10, seed: int = 11):
    """Fresh random prompts of 3-60 tokens, 2-9 output tokens, sampled with a seed each."""
    return closed_loop(n, 1, prompt_tokens=(3, 60), output_tokens=(2, 9), seed=seed,
                       vocab=token_space_of(llm))


def _check_timings(result: RunResult, n: int) -> None:
    assert len(result.records) == n and result.num_dropped == 0
    for r in result.records:
        assert 0 <= r.arrival <= r.admitted <= r.first_token <= r.finish <= result.duration_s
        assert r.latency_per_output_token == (r.finish - r.arrival) / r.num_output_tokens > 0
        assert len(r.logprobs) == r.num_output_tokens
    stats = result.latency_per_output_token
    assert 0 < stats.p50 <= stats.p90 <= stats.p99
    assert result.throughput > 0 and result.to_json()["num_requests"] == n


def test_closed_loop_keeps_at_most_concurrency_requests_in_flight(engines) -> None:
    llm = engines["detent"]
    w = _requests(llm).as_closed_loop(3)
    result = run_workload(llm, w)
    _check_timings(result, 10)
    assert result.max_in_flight == 3
    assert [r.num_output_tokens for r in result.records] == [r.max_tokens for r in w.requests]
    for r in result.records:  # from the timings alone: requests admitted and unfinished at each admission
        assert r.arrival == r.admitted
        assert sum(o.admitted <= r.admitted < o.finish for o in result.records) <= 3


def test_detent_outputs_are_bit_identical_at_concurrency_1_and_4(engines) -> None:
    llm = engines["detent"]
    w = _requests(llm, 12, seed=23)
    alone, batched = run_workload(llm, w.as_closed_loop(1)), run_workload(llm, w.as_closed_loop(4))
    assert (alone.max_in_flight, batched.max_in_flight) == (1, 4)
    assert alone.digest == batched.digest and same_outputs(alone, batched)
    # the digest sees the bits: stock's fp32 rows depend on the batch (benchmarks/RESULTS.md, "CPU battery")
    stock = engines["stock"]
    assert run_workload(stock, w.as_closed_loop(1)).digest != run_workload(stock, w.as_closed_loop(4)).digest


def test_open_loop_admits_requests_after_their_arrival(engines) -> None:
    llm = engines["detent"]
    w = sharegpt_like(scale=0.03, vocab=token_space_of(llm)).with_poisson_arrivals(200.0, seed=1)
    result = run_workload(llm, w)
    _check_timings(result, len(w.requests))
    assert [r.arrival for r in result.records] == [r.arrival for r in w.requests]
    cut = run_workload(llm, long_documents(6, prompt_tokens=40, output_tokens=3, rate=1.0,
                                           vocab=token_space_of(llm)), admit_until=0.0)
    assert (len(cut.records), cut.num_dropped) == (1, 5)  # only the request arriving at 0 was admitted


def test_peak_and_fit(engines) -> None:
    llm = engines["detent"]
    peak = measure_peak(llm, _requests(llm, 8), max_requests=6)
    assert peak.num_requests == 6 and peak.requests_per_s > 0
    assert peak.loads((0.5, 1.0)) == [0.5 * peak.requests_per_s, peak.requests_per_s]
    space = token_space_of(llm)
    assert space.vocab == 320 and {256, 257, 260} <= space.reserved
    with pytest.raises(BadInput, match="max_model_len"):
        run_workload(llm, long_documents(1, prompt_tokens=300, output_tokens=2, vocab=space))
