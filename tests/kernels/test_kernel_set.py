"""KernelSet: modes, selectors called with the runtime inputs, params passed through to the families."""

from __future__ import annotations

import pytest
import torch

from detent_audit.kernels import (
    DET_GEMM,
    AttentionMetadata,
    AttentionParams,
    GemmParams,
    KernelSet,
    MoeParams,
    SelectorError,
    gemm,
)
from detent_audit.kernels.params import BadParams


def test_constructors():
    assert KernelSet.stock().mode == "stock" and KernelSet.stock().select_gemm(num_tokens=3) is None
    det = KernelSet.det()
    assert det.mode == "det" and det.select_gemm(num_tokens=1) == det.select_gemm(num_tokens=999) == DET_GEMM
    fixed = KernelSet.fixed(gemm=GemmParams(8), attention=AttentionParams(32, 64))
    assert fixed.mode == "detent" and fixed.select_moe(num_tokens=5) == MoeParams(GemmParams(8))
    with pytest.raises(BadParams):
        KernelSet("fast", *([lambda **_: None] * 3))
    with pytest.raises(BadParams):
        KernelSet.fixed(gemm=8, attention=AttentionParams(32))


def test_selectors_receive_the_runtime_inputs(randn):
    calls = []

    def select_gemm(**kw):
        calls.append(("gemm", kw))
        return GemmParams(2)

    def select_attention(**kw):
        calls.append(("attention", kw))
        return AttentionParams(16)

    def select_moe(**kw):
        calls.append(("moe", kw))
        return MoeParams(GemmParams(2))

    ks = KernelSet("detent", select_gemm, select_attention, select_moe)
    x, w = randn(5, 16), randn(12, 16)
    assert torch.equal(ks.linear(x, w), gemm.linear(x, w, params=GemmParams(2)))
    k_cache, v_cache = randn(4, 4, 1, 8), randn(4, 4, 1, 8)
    meta = AttentionMetadata.from_lengths([3, 0], [1, 2], torch.tensor([[0, 1], [2, 3]]), 4)
    out = ks.attention(randn(3, 2, 8), k_cache, v_cache, meta, scale=0.3)
    assert out.shape == (3, 2, 8)
    ks.moe(randn(6, 16), randn(6, 4), randn(4, 8, 16), randn(4, 16, 4), 2, True)
    assert calls == [("gemm", {"num_tokens": 5}),
                     ("attention", {"num_seqs": 2, "max_seqlen_q": 2, "max_seqlen_k": 4}),
                     ("moe", {"num_tokens": 6})]


def test_a_selector_without_params_outside_stock_is_an_error(randn):
    ks = KernelSet("det", lambda **_: None, lambda **_: AttentionParams(16), lambda **_: GemmParams(4))
    with pytest.raises(SelectorError):
        ks.linear(randn(2, 4), randn(3, 4))
    with pytest.raises(SelectorError):
        ks.moe(randn(2, 4), randn(2, 2), randn(2, 4, 4), randn(2, 4, 2), 1, False)
