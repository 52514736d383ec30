"""route and fused_moe: with MoeParams a row's output bits depend only on that row."""

from __future__ import annotations

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.kernels import moe, reference
from detent_audit.kernels.params import GemmParams, MoeParams

E, H, INTER, TOP_K = 8, 64, 32, 2
# Against float64 from the same inputs, relative to max|ref|: fp32 GEMM chains round ~1e-6; bf16 rounds the
# hidden and expert outputs to 8 bits (~1e-2 relative).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _weights(randn, dtype):
    return randn(E, 2 * INTER, H, dtype=dtype, scale=H**-0.5), randn(E, H, INTER, dtype=dtype,
                                                                     scale=INTER**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 8])
def test_rows_keep_their_bits_in_any_batch(threads, randn, gen, dtype, chunk_rows):
    w13, w2 = _weights(randn, dtype)
    x, logits = randn(48, H, dtype=dtype), randn(48, E, dtype=dtype, scale=2.0)
    params = MoeParams(GemmParams(chunk_rows))
    run = lambda a, b: moe.fused_moe(a, b, w13, w2, TOP_K, True, params=params)  # noqa: E731
    full = run(x, logits)
    assert full.dtype == dtype and full.shape == (48, H)
    for k in (1, 2, 5, 17, 47):
        assert torch.equal(run(x[:k], logits[:k]), full[:k]), k
    perm = torch.randperm(48, generator=gen)
    assert torch.equal(run(x[perm], logits[perm]), full[perm])
    for size in (1, 3, 16, 64):
        bx, bl = randn(size, H, dtype=dtype), randn(size, E, dtype=dtype, scale=2.0)
        at = int(torch.randint(size, (1,), generator=gen))
        bx[at], bl[at] = x[5], logits[5]
        assert torch.equal(run(bx, bl)[at], full[5]), size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_close_to_float64_reference(randn, dtype, renormalize):
    w13, w2 = _weights(randn, dtype)
    x, logits = randn(20, H, dtype=dtype), randn(20, E, scale=2.0)
    ref = reference.fused_moe(x, logits, w13, w2, TOP_K, renormalize)
    for params in (None, MoeParams(GemmParams(4))):
        out = moe.fused_moe(x, logits, w13, w2, TOP_K, renormalize, params=params)
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert err <= REL_TOL[dtype], (params, float(err))


def test_route_ties_go_to_the_lower_expert_and_weights_renormalise(gen):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    routing = moe.route(logits, 2, renormalize=True)
    assert routing.ids.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(routing.weights, torch.full((2, 2), 0.5))
    assert routing.weights.dtype == torch.float32
    many = torch.randn(64, 16, generator=gen)
    plain = moe.route(many, 4, renormalize=False)
    ref = reference.route(many, 4, renormalize=False)
    assert torch.equal(plain.ids, ref.ids)
    torch.testing.assert_close(plain.weights.double(), ref.weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(moe.route(many[:5], 4, False).weights, plain.weights[:5])
    with pytest.raises(BadInput):
        moe.route(many, 17, renormalize=False)


def test_stock_is_not_batch_invariant_on_this_cpu(randn):
    """Recorded fact: stock runs each expert's rows as one F.linear, so a row's bits depend on its group."""
    w13, w2 = _weights(randn, torch.float32)
    x, logits = randn(64, H), randn(64, E, scale=2.0)
    alone = moe.fused_moe(x[:1], logits[:1], w13, w2, TOP_K, True)
    crowded = moe.fused_moe(x, logits, w13, w2, TOP_K, True)[:1]
    if torch.equal(alone, crowded):
        pytest.skip("stock MoE happened to be invariant for these shapes here")
    assert not torch.equal(alone, crowded)
