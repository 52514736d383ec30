"""The measurement behind the plugin's default GEMM: vLLM's fp32 oneDNN GEMM (`onednn_mm`, what vLLM CPU
dispatches unquantized fp32 linears to) gives a row the same bits whatever M is and whatever the other rows
hold, at 1 and 2 threads, on fresh random inputs of the shapes a small llama has."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402

from detent_audit.runtime.threads import thread_count  # noqa: E402

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152 // 8), (96, 192)]  # (K, N)
ROWS = [1, 2, 3, 4, 5, 7, 8, 11, 16, 33, 64, 100, 257, 600]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k, n", SHAPES)
def test_onednn_rows_do_not_depend_on_the_batch(threads: int, k: int, n: int) -> None:
    with thread_count(threads):
        gen = torch.Generator().manual_seed(k * 7 + n + threads)
        weight = torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen) if n == 192 else None
        handler = ops.create_onednn_mm(weight.t(), 32)
        x = torch.randn(max(ROWS), k, generator=gen)
        full = ops.onednn_mm(handler, x, bias)
        for m in ROWS:
            assert torch.equal(ops.onednn_mm(handler, x[:m].clone(), bias), full[:m]), (m, k, n)
            # the same rows after other data: row bits depend on the row only
            other = torch.cat([torch.randn(5, k, generator=gen), x[:m]])
            assert torch.equal(ops.onednn_mm(handler, other, bias)[5:], full[:m]), (m, k, n)
