"""The tuner's profile: served at a concurrency, the recorded calls carry the batch sizes that concurrency
serves at, over the same tokens; `tune_engine` adds up the passes of each concurrency asked for."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from detent_audit.engine import tune, tune_record
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import SamplingParams


def _requests(seed: int, n: int = 7):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(5, 200) for _ in range(rng.randint(3, 60))],
             SamplingParams(max_tokens=rng.randint(2, 9), ignore_eos=True)) for i in range(n)]


def _batches(calls: dict[str, Counter]) -> Counter:
    """The attention's batch sizes: {sequences in a call: calls}."""
    out: Counter = Counter()
    for (seqs, *_), count in calls["embedded.attention"].items():
        out[len(seqs)] += count
    return out


def _tokens(calls: dict[str, Counter]) -> int:
    return sum(sum(q for _, q in seqs) * count for (seqs, *_), count in calls["embedded.attention"].items())


@pytest.mark.parametrize("seed", [0, 1])
def test_profile_runs_at_the_concurrency_asked_over_the_same_tokens(seed) -> None:
    llm = LLM(EngineConfig(model="random:tiny-llama", max_model_len=256, num_kv_blocks=256))
    requests = _requests(seed)
    recorded = {}
    for limit in (1, 3, None):
        llm.reset()
        recorded[limit] = tune_record.record_calls(llm, requests, limit)
    assert set(_batches(recorded[1])) == {1}
    assert max(_batches(recorded[3])) == 3
    assert max(_batches(recorded[None])) > 3
    assert _tokens(recorded[1]) == _tokens(recorded[3]) == _tokens(recorded[None])
    assert not llm.has_unfinished()


def test_tune_engine_adds_up_the_passes(monkeypatch) -> None:
    llm = LLM(EngineConfig(model="random:tiny-llama", max_model_len=256, num_kv_blocks=256))
    requests = _requests(5)
    expected: dict[str, Counter] = {}
    for limit in (1, None):
        llm.reset()
        for family, counter in tune_record.record_calls(llm, requests, limit).items():
            expected.setdefault(family, Counter()).update(counter)
    seen = {}

    def heaviest(family, counter):
        seen[family] = Counter(counter)
        return real(family, counter)

    real = tune.heaviest
    monkeypatch.setattr(tune, "heaviest", heaviest)
    llm.reset()
    tune.tune_engine(llm, requests, concurrency=(1, None))
    assert seen == expected


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_bad_concurrency_is_refused(bad) -> None:
    llm = LLM(EngineConfig(model="random:tiny-llama", max_model_len=256, num_kv_blocks=256))
    with pytest.raises(BadInput, match="concurrency"):
        tune_record.record_calls(llm, _requests(0, 2), bad)
    with pytest.raises(BadInput, match="concurrency"):
        tune.tune_engine(llm, _requests(0, 2), concurrency=())
