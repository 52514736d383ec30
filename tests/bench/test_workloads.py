"""The synthetic workloads: seeded, in the vocabulary, with the stated prefix reuse and arrival rates."""

from __future__ import annotations

import statistics

import pytest

from detent_audit.bench.workloads import (
    Request,
    TokenSpace,
    Workload,
    closed_loop,
    long_documents,
    poisson_arrivals,
    sharegpt_like,
)
from detent_audit.errors import BadInput

SPECIALS = TokenSpace(320, frozenset(range(256, 261)))  # tiny-llama: 256 bytes, then 5 special tokens


def test_generators_are_seeded_and_deterministic() -> None:
    for make in (lambda s: sharegpt_like(seed=s, scale=0.2),
                 lambda s: long_documents(8, prompt_tokens=64, seed=s), lambda s: closed_loop(8, 2, seed=s)):
        assert make(3) == make(3)
        assert make(3).requests != make(4).requests


def test_sharegpt_default_repeats_the_previous_turn_for_about_64_percent_of_prompt_tokens() -> None:
    w = sharegpt_like()
    assert len(w.requests) == 600
    assert 0.60 <= w.repeat_fraction <= 0.68, w.repeat_fraction
    previous: dict[int, Request] = {}
    for r in w.requests:
        before = previous.get(r.conversation)
        if before is None:
            assert r.turn == 0 and r.repeated_tokens == 0
        else:  # this prompt = the previous prompt + its answer's stand-in + a new user message
            assert r.turn == before.turn + 1
            assert r.repeated_tokens == len(before.prompt_token_ids) + before.max_tokens
            assert r.prompt_token_ids[:len(before.prompt_token_ids)] == before.prompt_token_ids
        previous[r.conversation] = r
    assert max(r.turn for r in w.requests) >= 3
    answers = sorted(r.max_tokens for r in w.requests)
    assert 100 <= answers[len(answers) // 2] <= 300  # median answer length


def test_scale_shrinks_counts_and_lengths() -> None:
    full, small = sharegpt_like(), sharegpt_like(scale=0.25)
    assert len(small.requests) == 150
    assert small.num_prompt_tokens / len(small.requests) < 0.5 * full.num_prompt_tokens / len(full.requests)
    with pytest.raises(BadInput, match="scale"):
        sharegpt_like(scale=0)


def test_poisson_inter_arrival_mean_is_one_over_rate() -> None:
    rate = 7.5
    times = poisson_arrivals(20000, rate, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    w = long_documents(2000, prompt_tokens=8, output_tokens=1, rate=rate, seed=2)
    assert w.kind == "open"
    gaps = [b.arrival - a.arrival for a, b in zip(w.requests, w.requests[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.1)


def test_token_ids_are_ordinary_ids_of_the_vocabulary() -> None:
    for w in (sharegpt_like(scale=0.2, vocab=SPECIALS), long_documents(4, prompt_tokens=512, vocab=SPECIALS),
              closed_loop(16, 4, vocab=SPECIALS)):
        ids = {t for r in w.requests for t in r.prompt_token_ids}
        assert max(ids) < 320 and min(ids) >= 0 and not ids & SPECIALS.reserved, w.name
        assert max(ids) > 260  # the ids above the specials are drawn too
        assert all(r.ignore_eos for r in w.requests)
    with pytest.raises(BadInput, match="reserved"):
        TokenSpace(3, frozenset({0, 1, 2}))


def test_long_documents_and_closed_loop_shapes() -> None:
    docs = long_documents(6, prompt_tokens=8192, output_tokens=64, rate=2.0)
    assert all(7168 <= len(r.prompt_token_ids) <= 8192 and r.max_tokens == 64 for r in docs.requests)
    assert docs.max_len <= 8192 + 64
    c1, c8 = closed_loop(10, 1, seed=5), closed_loop(10, 8, seed=5)
    assert (c1.kind, c1.concurrency, c8.concurrency) == ("closed", 1, 8)
    assert c1.requests == c8.requests  # the concurrency does not change the requests
    assert all(128 <= len(r.prompt_token_ids) <= 1024 for r in c1.requests)


def test_retiming_keeps_the_requests() -> None:
    w = closed_loop(12, 2, seed=1)
    open_loop = w.with_poisson_arrivals(3.0, seed=9, name="poisson")
    assert open_loop.kind == "open" and open_loop.name == "poisson" and open_loop.params["rate"] == 3.0
    assert [r.prompt_token_ids for r in open_loop.requests] == [r.prompt_token_ids for r in w.requests]
    assert {r.arrival for r in open_loop.at_time_zero().requests} == {0.0}
    back = open_loop.as_closed_loop(4)
    assert back.concurrency == 4 and "rate" not in back.params
    assert all(r.arrival is None for r in back.requests)
    assert len(w.head(5).requests) == 5


def test_workload_rejects_inconsistent_timing() -> None:
    r = Request(0, (1, 2), 4)
    with pytest.raises(BadInput, match="open loop needs every arrival"):
        Workload("w", "open", (r,))
    with pytest.raises(BadInput, match="closed loop needs a concurrency"):
        Workload("w", "closed", (r,))
    late, early = Request(0, (1,), 1, arrival=2.0), Request(1, (1,), 1, arrival=1.0)
    with pytest.raises(BadInput, match="non-decreasing"):
        Workload("w", "open", (late, early))
    with pytest.raises(BadInput, match="indices"):
        Workload("w", "closed", (Request(1, (1,), 1),), concurrency=1)
