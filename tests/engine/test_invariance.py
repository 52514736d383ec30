"""The engine's batch invariance, end to end on tiny random checkpoints (CPU):
the 35-cell battery, rescoring equal to generation, seeded sampling alone and in a mixed batch."""

from __future__ import annotations

import random

import pytest
import torch

from detent_audit.bench.battery import run_battery
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.threads import set_threads


def _engine(path, mode="detent", dtype="float32", **kw) -> LLM:
    return LLM(EngineConfig(model=str(path), mode=mode, dtype=dtype, max_num_seqs=40,
                            max_num_batched_tokens=256, num_kv_blocks=2048, **kw))


def _bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


@pytest.mark.parametrize(("shape", "dtype"), [("tiny-llama", "float32"), ("tiny-llama", "bfloat16"),
                                              ("tiny-qwen3", "float32"), ("tiny-qwen3-moe", "bfloat16")])
def test_detent_passes_every_battery_cell(make_checkpoint, shape: str, dtype: str, tmp_path) -> None:
    llm = _engine(make_checkpoint(shape), dtype=dtype, cache_dir=str(tmp_path))
    results = run_battery(llm, seed=1)
    assert len(results) == 35
    failed = [(r.name, r.first_diff) for r in results if not r.passed]
    assert not failed, failed


def test_stock_fails_co_batched_cells_in_fp32(make_checkpoint, tmp_path) -> None:
    """The battery can fail: stock kernels read the batch (whole-batch GEMMs, padded SDPA)."""
    llm = _engine(make_checkpoint("tiny-llama"), mode="stock", cache_dir=str(tmp_path))
    results = run_battery(llm, seed=1)
    failed = {r.name for r in results if not r.passed}
    assert "co-long-7" in failed and "rerun-alone" not in failed, failed


def test_rescore_equals_generation_for_100_requests(make_checkpoint, tmp_path) -> None:
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = []
    for i in range(100):  # a third share a 16- or 32-token prefix (prefix-cache hits), lengths up to 90
        head = shared[: rng.choice([16, 32])] if i % 3 == 0 else []
        prompts.append(head + [rng.randrange(256) for _ in range(rng.randint(1, 60))])
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]), seed=i,
                             max_tokens=rng.randint(1, 12), ignore_eos=True) for i in range(100)]
    llm = _engine(make_checkpoint("tiny-llama"), cache_dir=str(tmp_path), max_prefill_chunk=24)
    outs = llm.generate(prompts, params)
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 10
    scorer = _engine(make_checkpoint("tiny-llama"), cache_dir=str(tmp_path), max_prefill_chunk=64)
    scores = scorer.rescore_batch([(o.prompt_token_ids, o.token_ids) for o in outs], params)
    for o, s in zip(outs, scores):
        assert torch.equal(_bits(s.logprobs), _bits(o.logprobs)), o.request_id
        assert s.tokens == o.token_ids  # the seeded draws at every position, recomputed from the logits
    # and in the serving engine itself, after its prefix cache filled
    again = llm.rescore_batch([(o.prompt_token_ids, o.token_ids) for o in outs[:20]])
    for o, s in zip(outs, again):
        assert torch.equal(_bits(s.logprobs), _bits(o.logprobs))


def test_a_response_that_fills_the_context_rescores_within_it(make_checkpoint, tmp_path) -> None:
    """Prompt plus output equal to max_model_len (what a chat request without max_tokens gets): rescoring
    feeds every output token but the last, so it fits, and gives the served bits, beside shorter requests."""
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (40, 63, 1, 17)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=64 - len(p), ignore_eos=True)
              for i, (p, t) in enumerate(zip(prompts, (0.0, 0.8, 0.8, 0.0)))]
    llm = _engine(make_checkpoint("tiny-llama"), cache_dir=str(tmp_path), max_model_len=64)
    outs = llm.generate(prompts, params)
    assert all(len(o.prompt_token_ids) + len(o.token_ids) == 64 for o in outs)
    short = llm.generate([prompts[0][:5]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    scores = llm.rescore_batch([(o.prompt_token_ids, o.token_ids) for o in outs + short],
                               params + [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)])
    for o, s in zip(outs + short, scores):
        assert torch.equal(_bits(s.logprobs), _bits(o.logprobs)) and s.tokens == o.token_ids


def test_seeded_sampling_alone_and_in_a_mixed_batch_of_32(make_checkpoint, tmp_path) -> None:
    path = make_checkpoint("tiny-qwen3")
    rng = random.Random(3)
    target = [rng.randrange(256) for _ in range(30)]
    target_params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16,
                                   ignore_eos=True)
    alone = _engine(path, cache_dir=str(tmp_path)).generate([target], target_params)[0]
    kinds = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.8, seed=6, max_tokens=10, ignore_eos=True)]
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 80))] for _ in range(31)]
    batch = prompts[:13] + [target] + prompts[13:]
    params = [kinds[i % 3] for i in range(13)] + [target_params] + [kinds[i % 3] for i in range(13, 31)]
    inside = _engine(path, cache_dir=str(tmp_path)).generate(batch, params)[13]
    assert inside.token_ids == alone.token_ids
    assert torch.equal(_bits(inside.logprobs), _bits(alone.logprobs))
    other_seed = _engine(path, cache_dir=str(tmp_path)).generate(
        [target], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=16,
                                 ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids  # the seed matters


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_detent_bits_do_not_depend_on_the_thread_count(make_checkpoint, tmp_path, dtype: str) -> None:
    """Measured property of this CPU's kernels (fixed-M GEMM chunks, >=2-element attention batches):
    generation at 1 thread and rescoring at 2 give the same bits. The thread count stays a recorded fact."""
    path = make_checkpoint("tiny-llama")
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 90))] for _ in range(12)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.9]), seed=i, max_tokens=8, ignore_eos=True)
              for i in range(12)]
    outs = _engine(path, dtype=dtype, cache_dir=str(tmp_path), num_threads=1).generate(prompts, params)
    try:
        scorer = _engine(path, dtype=dtype, cache_dir=str(tmp_path), num_threads=2)
        scores = scorer.rescore_batch([(o.prompt_token_ids, o.token_ids) for o in outs], params)
    finally:
        set_threads(1)
    for o, s in zip(outs, scores):
        assert torch.equal(_bits(s.logprobs), _bits(o.logprobs)) and s.tokens == o.token_ids
