"""GPU tier: the tuner's attention oracle, warm (one K/V read by every launch) and cold (`cold_kv`: launches
read K/V copies that together pass the L2 twice over). Skipped without CUDA and Triton."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("detent_audit.kernels.triton_attention")

from detent_audit.engine.tune_search import GPU_LAUNCHES, GraphShape, Oracle  # noqa: E402
from detent_audit.selection.tuner import Assignment  # noqa: E402

FAMILY = "embedded.attention"
A = Assignment(kv_tile=64, split_stride=1024)


@pytest.mark.parametrize("graphs", [None, GraphShape(4096, 8)], ids=["eager", "graph"])
def test_cold_oracle_rotates_copies_that_pass_the_l2(graphs) -> None:
    call = (((700, 1),) * 8, 32, 8, 128, "torch.bfloat16")  # 8 decode rows at 700 tokens: ~11 MB of K/V
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    warm, cold = Oracle(0, "cuda", True, graphs), Oracle(0, "cuda", True, graphs, cold_kv=True)
    runs = cold._prepare_gpu_attention(A, call)
    q, k, v, *_ = cold._inputs[call]
    assert len(runs) == min(GPU_LAUNCHES, math.ceil(2 * l2 / (k.nbytes + v.nbytes))) > 1
    assert len(warm._prepare_gpu_attention(A, call)) == 1
    outs = [run() for run in runs]  # each launch reads its own copy: different K/V, different outputs
    assert not torch.equal(outs[0], outs[1])
    for oracle in (warm, cold):
        t = oracle(FAMILY, A, call)
        assert math.isfinite(t) and t > 0
