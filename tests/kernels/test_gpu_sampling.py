"""GPU tier: seeded sampling and the logprobs the receipts carry give a row the same bits alone, in any
batch and in any order, at real vocabulary sizes; they agree with the CPU within a stated tolerance.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from detent_audit.kernels import sampling  # noqa: E402


def _batch(rows: int, vocab: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    temperature = torch.where(torch.rand(rows, device="cuda", generator=g) < 0.2, 0.0,
                              0.2 + torch.rand(rows, device="cuda", generator=g))
    top_k = torch.randint(0, 50, (rows,), device="cuda", generator=g)
    top_p = 0.5 + 0.5 * torch.rand(rows, device="cuda", generator=g)
    seeds = torch.randint(-(2 ** 62), 2 ** 62, (rows,), device="cuda", generator=g)
    positions = torch.randint(0, 8192, (rows,), device="cuda", generator=g)
    return logits, temperature, top_k, top_p, seeds, positions


@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
def test_a_rows_draw_and_logprobs_do_not_depend_on_the_batch(vocab: int) -> None:
    args = _batch(300, vocab, seed=vocab)
    tokens = sampling.sample(*args)
    lps = sampling.token_logprobs(args[0], tokens)
    top = sampling.top_logprobs(args[0], 5)
    perm = torch.randperm(300, device="cuda")
    for rows in (torch.arange(1, device="cuda"), torch.arange(7, device="cuda"), perm[:64], perm):
        sub = [a[rows] for a in args]
        assert torch.equal(sampling.sample(*sub), tokens[rows])
        assert torch.equal(sampling.token_logprobs(sub[0], tokens[rows]), lps[rows])
        t = sampling.top_logprobs(sub[0], 5)
        assert torch.equal(t.ids, top.ids[rows]) and torch.equal(t.logprobs, top.logprobs[rows])
    # against the CPU: greedy rows draw the same token; logprobs within fp32 rounding of a log-sum-exp
    cpu_lps = sampling.token_logprobs(args[0].cpu(), tokens.cpu())
    assert (lps.cpu() - cpu_lps).abs().max().item() < 1e-4
    greedy = args[1] == 0
    assert torch.equal(tokens[greedy].cpu(), args[0][greedy].cpu().argmax(-1))
