"""The finish rule is one function: the scheduler finishes a sequence exactly where `finish_cause` says, and
the verifier accepts that finish and refuses any other, on random requests and token streams (stop tokens,
EOS, stop strings, max_tokens, max_model_len)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from detent_audit.engine.scheduler import Scheduler, SchedulerConfig
from detent_audit.engine.sequence import Sequence
from detent_audit.runtime.finish import FinishCause, finish_cause
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.verifier.checks import _finish_problem

EOS, VOCAB, MAX_MODEL_LEN = 0, 12, 24


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.3,
                          stop_token_ids=tuple(rng.sample(range(1, VOCAB), rng.randint(0, 2))),
                          stop=tuple(decode([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 2))])
                                     for _ in range(rng.randint(0, 2))))


def run(params: SamplingParams, prompt: list[int], stream: list[int]) -> Sequence:
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
                          eos_token_ids=(EOS,))
    sched = Scheduler(cfg, decode=decode)
    seq = Sequence(0, prompt, params)
    sched.add(seq)
    tokens = iter(stream)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {e.seq.seq_id: next(tokens) if e.samples_token else None for e in out.scheduled})
    return seq


def expected_end(params: SamplingParams, prompt: list[int], stream: list[int]) -> tuple[int, FinishCause]:
    """The first position where the rule finishes the stream (stop strings from the decoded text)."""
    for n in range(1, len(stream) + 1):
        text, before = decode(stream[:n]), decode(stream[:n - 1])
        completed = any(s in text for s in params.stop) and not any(s in before for s in params.stop)
        cause = finish_cause(stream[n - 1], n, len(prompt) + n, params, (EOS,), MAX_MODEL_LEN,
                             stop_string=completed)
        if cause is not None:
            return n, cause
    raise AssertionError("the stream never finishes")


def receipt(params: SamplingParams, prompt: list[int], tokens: list[int], reason: str) -> SimpleNamespace:
    """What `_finish_problem` reads of a receipt."""
    return SimpleNamespace(request=SimpleNamespace(sampling=params, prompt_token_ids=prompt),
                           output=SimpleNamespace(token_ids=tokens, finish_reason=reason), scoring=None)


@pytest.mark.parametrize("seed", range(6))
def test_scheduler_and_verifier_apply_the_one_rule(seed: int) -> None:
    rng = random.Random(seed)
    causes = set()
    for _ in range(80):
        params = random_params(rng)
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 16))]
        stream = [rng.choice([EOS, *range(1, VOCAB)]) for _ in range(MAX_MODEL_LEN)]
        n, cause = expected_end(params, prompt, stream)
        seq = run(params, prompt, stream)
        assert (seq.output_token_ids, seq.finish_reason) == (stream[:n], cause.reason)
        causes.add(cause)
        assert _finish_problem(receipt(params, prompt, stream[:n], cause.reason), {EOS}, MAX_MODEL_LEN,
                               decode) is None
        other = "length" if cause.reason == "stop" else "stop"
        assert _finish_problem(receipt(params, prompt, stream[:n], other), {EOS}, MAX_MODEL_LEN,
                               decode) is not None
        if n > 1:  # cut early, under either reason: a stop or a limit the rule would not have reached there
            for reason in ("stop", "length"):
                assert _finish_problem(receipt(params, prompt, stream[:n - 1], reason), {EOS}, MAX_MODEL_LEN,
                                       decode) is not None
        if n < len(stream):  # generation that went on past the finish
            assert _finish_problem(receipt(params, prompt, stream[:n + 1], cause.reason), {EOS},
                                   MAX_MODEL_LEN, decode) is not None
    assert len(causes) >= 4, causes


def test_a_stop_wins_over_a_limit_reached_on_the_same_token() -> None:
    params = SamplingParams(max_tokens=2, stop_token_ids=(7,))
    assert finish_cause(7, 2, 30, params, (EOS,), 30) is FinishCause.STOP_TOKEN
    assert finish_cause(EOS, 2, 30, params, (EOS,), 30) is FinishCause.EOS
    assert finish_cause(3, 2, 30, params, (EOS,), 30, stop_string=True) is FinishCause.STOP_STRING
    assert finish_cause(3, 2, 30, params, (EOS,), 30) is FinishCause.MAX_TOKENS
    assert finish_cause(3, 1, 30, params, (EOS,), 30) is FinishCause.MAX_MODEL_LEN
    assert finish_cause(EOS, 1, 29, SamplingParams(max_tokens=2, ignore_eos=True), (EOS,), 30) is None
