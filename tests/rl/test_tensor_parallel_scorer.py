"""The scorer in one process matches rollouts served at TP=N: its exact forward runs the N ranks' shards by
rank emulation (the served TP=N bits), its gradients come from the full model."""

from __future__ import annotations

import random

import pytest
import torch

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.tensor_parallel import TensorParallelLM
from detent_audit.errors import BadInput
from detent_audit.rl.scorer import Scorer
from detent_audit.runtime.sampling_params import SamplingParams

MODEL = "random:tiny-llama"


def bits(x) -> torch.Tensor:
    t = x.detach() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float32)
    return t.to(torch.float32).view(torch.int32)


def served(llm: LLM, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(2, 12))] for _ in range(5)]
    params = [SamplingParams(temperature=1.0, seed=rng.randrange(1 << 40), max_tokens=rng.randint(1, 6),
                             ignore_eos=True) for _ in prompts]
    return llm.generate(prompts, params)


def score_and_check(outs, size: int) -> None:
    emulated = LLM(EngineConfig(model=MODEL, tensor_parallel_size=size, tensor_parallel_ranks="emulated"))
    assert isinstance(emulated.model, TensorParallelLM)
    full = LLM(model=MODEL).model
    with pytest.raises(BadInput, match="needs the full model"):
        Scorer(emulated)
    scorer = Scorer(emulated, policy=full)
    order = [4, 1, 3, 0, 2]
    scored = scorer.score([(outs[i].prompt_token_ids, outs[i].token_ids) for i in order], micro_batch=3)
    for lp, i in zip(scored.logprobs, order):
        assert torch.equal(bits(lp), bits(outs[i].logprobs))
    sum(lp.sum() for lp in scored.logprobs).backward()
    assert full.layers[0].mlp.down_proj.weight.grad is not None
    # a plain TP=1 rescore gives other bits somewhere: the emulation is what matches
    plain = LLM(model=MODEL).rescore_batch([(o.prompt_token_ids, o.token_ids) for o in outs])
    assert any(not torch.equal(bits(p.logprobs), bits(o.logprobs)) for p, o in zip(plain, outs))


def test_scorer_by_rank_emulation_matches_tp2_rollouts() -> None:
    rollout = LLM(EngineConfig(model=MODEL, tensor_parallel_size=2, tensor_parallel_ranks="emulated"))
    score_and_check(served(rollout, 1), 2)


@pytest.mark.slow
def test_scorer_by_rank_emulation_matches_rollouts_of_two_rank_processes() -> None:
    rollout = LLM(EngineConfig(model=MODEL, tensor_parallel_size=2))  # rank 0 here, rank 1 a process
    try:
        outs = served(rollout, 2)
    finally:
        rollout.shutdown()
    score_and_check(outs, 2)
