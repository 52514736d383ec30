"""The parity gate: one flipped bit in one rollout logprob stops the step, naming the sample, the position and
both values; told to log, it reports the metrics instead."""

from __future__ import annotations

import random

import pytest
import torch

from detent_audit.engine.llm import LLM
from detent_audit.rl.gate import LogprobMismatch, ParityGate, float_bits
from detent_audit.rl.scorer import Scorer
from detent_audit.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def scored():
    llm = LLM(model="random:tiny-llama")
    rng = random.Random(7)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(2, 9))] for _ in range(4)]
    params = [SamplingParams(temperature=1.0, seed=rng.randrange(1 << 32), max_tokens=5, ignore_eos=True)
              for _ in prompts]
    outs = llm.generate(prompts, params)
    trainer = Scorer(llm).score([(o.prompt_token_ids, o.token_ids) for o in outs], micro_batch=3).logprobs
    return [o.logprobs for o in outs], trainer


def test_the_gate_passes_the_scorer_and_reports_zero_mismatch(scored) -> None:
    rollout, trainer = scored
    report = ParityGate().check(rollout, trainer)
    assert report.tokens == 20 and report.mismatched == 0 and report.first is None
    assert report.metrics()["logprob_bit_mismatch"] == 0.0
    assert report.metrics()["train_rollout_logprob_abs_diff"] == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_flipped_bit_stops_the_step_naming_sample_position_and_values(scored, seed: int) -> None:
    rollout, trainer = scored
    rng = random.Random(seed)
    sample, position, bit = rng.randrange(4), rng.randrange(5), rng.randrange(32)
    flipped = [list(r) for r in rollout]
    t = torch.tensor([flipped[sample][position]], dtype=torch.float32)
    t.view(torch.int32)[0] ^= 1 << bit
    flipped[sample][position] = float(t[0])
    was, now = rollout[sample][position], flipped[sample][position]
    with pytest.raises(LogprobMismatch) as err:
        ParityGate().check(flipped, trainer)
    assert err.value.message == (f"sample {sample}, position {position}: rollout logprob {now!r} "
                                 f"({float_bits(now)}) but trainer {was!r} ({float_bits(was)})")
    report = ParityGate(fail=False).check(flipped, trainer)
    assert report.mismatched == 1 and report.first == (sample, position)
    assert report.metrics()["logprob_bit_mismatch"] == 1 / 20
