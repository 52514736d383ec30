"""The vLLM plugin's default GEMM (the tuple's chunk form, `kernels.gemm` with 16-row chunks, the form it runs
unless a start-up probe proved another) gives a row the same bits whatever M is and whatever the other rows
hold, at 1 and 2 threads, on fresh random inputs of the shapes a small llama has, on whatever x86 CPU runs it.
vLLM's own fp32 oneDNN GEMM (`onednn_mm`, the plugin's opt-in `onednn` form) is not trusted: with the same
`rows_hold` check its rows held at these shapes on an AVX2 CPU, and on an AVX-512 Xeon (1 and 2 threads)
the down projection's (K=1536, N=576) did not."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from detent_audit.kernels.gemm import linear  # noqa: E402
from detent_audit.kernels.params import GemmParams  # noqa: E402
from detent_audit.runtime.threads import thread_count  # noqa: E402

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152 // 8), (96, 192)]  # (K, N)
ROWS = [1, 2, 3, 4, 5, 7, 8, 11, 16, 33, 64, 100, 257, 600]
CHUNK = GemmParams(16)


def rows_hold(product, x: torch.Tensor, gen: torch.Generator) -> bool:
    """Whether `product`'s rows have the same bits at every M of ROWS and after other rows."""
    full = product(x)
    for m in ROWS:
        if not torch.equal(product(x[:m].clone()), full[:m]):
            return False
        other = torch.cat([torch.randn(5, x.shape[1], generator=gen), x[:m]])
        if not torch.equal(product(other)[5:], full[:m]):
            return False
    return True


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k, n", SHAPES)
def test_the_plugins_gemm_rows_do_not_depend_on_the_batch(threads: int, k: int, n: int) -> None:
    with thread_count(threads):
        gen = torch.Generator().manual_seed(k * 7 + n + threads)
        weight = torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen) if n == 192 else None
        x = torch.randn(max(ROWS), k, generator=gen)
        assert rows_hold(lambda a: linear(a, weight, bias, params=CHUNK), x, gen), (k, n, threads)

