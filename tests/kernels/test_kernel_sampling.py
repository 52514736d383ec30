"""Seeded sampling: a row's token depends only on its logits, parameters, seed and position."""

from __future__ import annotations

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.kernels import reference, sampling

V = 1000
MASK64 = (1 << 64) - 1


def _splitmix(z: int) -> int:
    """SplitMix64's output function in plain Python integers (the spec the torch version must match)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_noise_is_splitmix64_of_seed_position_and_index():
    golden = 0x9E3779B97F4A7C15
    seeds, positions = torch.tensor([0, 7, -3, 2**62]), torch.tensor([0, 1, 123456, 2**40])
    u = sampling.uniform_noise(seeds, positions, 50)
    for row, (seed, pos) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        state = _splitmix(_splitmix(seed + golden) + (pos + 1) * golden)
        for v in (0, 1, 49):
            bits = _splitmix(state + (v + 1) * golden)
            assert u[row, v].item() == ((bits >> 11) + 0.5) * 2.0**-53
    assert bool(((u > 0) & (u < 1)).all())


def _params(gen, batch: int):
    return dict(
        temperature=torch.rand(batch, generator=gen) * 1.5 + 0.2,
        top_k=torch.randint(0, 50, (batch,), generator=gen),
        top_p=torch.where(torch.rand(batch, generator=gen) < 0.5, 1.0, 0.9),
        seeds=torch.randint(0, 2**62, (batch,), generator=gen),
        positions=torch.randint(0, 4096, (batch,), generator=gen),
    )


def test_same_seed_and_position_give_the_same_token_in_any_batch(threads, gen, randn):
    logits, params = randn(64, V, scale=3.0), _params(gen, 64)
    full = sampling.sample(logits, **params)
    for k in (1, 2, 9, 63):
        assert torch.equal(sampling.sample(logits[:k], **{n: t[:k] for n, t in params.items()}), full[:k])
    perm = torch.randperm(64, generator=gen)
    assert torch.equal(sampling.sample(logits[perm], **{n: t[perm] for n, t in params.items()}), full[perm])
    for row in (0, 31):
        alone = sampling.sample(logits[row : row + 1], **{n: t[row : row + 1] for n, t in params.items()})
        assert alone.item() == full[row].item()


def test_different_seeds_draw_differently_and_follow_the_distribution(gen):
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).expand(4000, 4).contiguous()
    draws = sampling.sample(logits, torch.ones(4000), torch.zeros(4000, dtype=torch.int64), torch.ones(4000),
                            torch.arange(4000), torch.full((4000,), 5))
    freq = torch.bincount(draws, minlength=4).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.03)
    by_position = sampling.sample(logits[:200], torch.ones(200), torch.zeros(200, dtype=torch.int64),
                                  torch.ones(200), torch.full((200,), 11), torch.arange(200))
    assert len(set(by_position.tolist())) == 4


def test_temperature_zero_is_argmax_with_lowest_index_on_ties(gen, randn):
    logits = randn(8, V)
    logits[3, [10, 20]] = 100.0  # a tie: 10 wins
    zeros = torch.zeros(8)
    tokens = sampling.sample(logits, zeros, torch.zeros(8, dtype=torch.int64), torch.ones(8),
                             torch.arange(8), torch.arange(8))
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[3].item() == 10
    mixed = _params(gen, 8)
    mixed["temperature"][::2] = 0.0
    assert torch.equal(sampling.sample(logits, **mixed)[::2], logits.argmax(-1)[::2])


def test_top_k_and_top_p_restrict_the_draws(gen, randn):
    logits = randn(1, V, scale=2.0).expand(300, V).contiguous()
    seeds = torch.arange(300)
    ones, pos = torch.ones(300), torch.zeros(300, dtype=torch.int64)
    top5 = set(logits[0].topk(5).indices.tolist())
    drawn = sampling.sample(logits, ones * 2, torch.full((300,), 5), ones, seeds, pos)
    assert set(drawn.tolist()) <= top5 and len(set(drawn.tolist())) > 1
    greedy = sampling.sample(logits, ones, torch.zeros(300, dtype=torch.int64), ones * 1e-6, seeds, pos)
    assert set(greedy.tolist()) == {int(logits[0].argmax())}
    probs = torch.softmax(logits[0], -1)
    sorted_probs, ids = probs.sort(descending=True)
    nucleus = set(ids[: int((sorted_probs.cumsum(0) < 0.5).sum()) + 1].tolist())
    drawn_p = sampling.sample(logits, ones, torch.zeros(300, dtype=torch.int64), ones * 0.5, seeds, pos)
    assert set(drawn_p.tolist()) <= nucleus


def test_logprobs(randn):
    logits = randn(16, V, scale=4.0)
    tokens = torch.arange(16) * 7
    lp = sampling.token_logprobs(logits, tokens)
    assert lp.dtype == torch.float32
    assert torch.equal(lp[:3], sampling.token_logprobs(logits[:3], tokens[:3]))
    torch.testing.assert_close(lp.double(), reference.log_softmax(logits)[torch.arange(16), tokens],
                               rtol=1e-6, atol=1e-5)
    tied = torch.zeros(2, 6)
    tied[:, [1, 4]] = 1.0
    top = sampling.top_logprobs(tied, 3)
    assert top.ids.tolist() == [[1, 4, 0], [1, 4, 0]]
    assert bool((top.logprobs[:, :-1] >= top.logprobs[:, 1:]).all())


def test_bad_sampling_parameters_raise(randn):
    logits = randn(2, 10)
    good = dict(temperature=torch.ones(2), top_k=torch.zeros(2, dtype=torch.int64), top_p=torch.ones(2),
                seeds=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64))
    for name, bad in (("temperature", torch.tensor([1.0, -1.0])), ("top_p", torch.tensor([0.0, 1.0])),
                      ("seeds", torch.zeros(3, dtype=torch.int64))):
        with pytest.raises(BadInput):
            sampling.sample(logits, **{**good, name: bad})
