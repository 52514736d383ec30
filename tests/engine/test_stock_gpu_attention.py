"""Stock mode's attention split on a GPU is FlashAttention-3's heuristic as its SelIR program computes it
(selection/programs/fa3.py), evaluated per launch on the batch; it runs on the host, so no GPU is needed."""

from __future__ import annotations

import random

import pytest

from detent_audit.engine.config import NAMED_SHAPES
from detent_audit.engine.kernel_select import STOCK_TILE, engine_deployment, stock_attention_selector
from detent_audit.kernels.gpu import fa3_num_splits


def deployment(shape: str):
    return engine_deployment(NAMED_SHAPES[shape], dtype="bfloat16", num_threads=1, block_size=16, max_model_len=32768,
                             max_num_seqs=256, max_num_batched_tokens=8192, prefix_caching=True,
                             batch_invariant=False)


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "llama-3.2-1b", "qwen3-30b-a3b"])
def test_the_program_agrees_with_the_hand_copy_on_random_batches(shape: str) -> None:
    dep = deployment(shape)
    rng = random.Random(shape)
    hkv, group = dep.num_kv_heads_per_rank, dep.num_heads_per_rank // dep.num_kv_heads_per_rank
    for sms in (16, 78, 114, 132):
        select = stock_attention_selector(dep, sms)
        for _ in range(1500):
            q = rng.choice([1, 1, 1, rng.randint(1, 64), rng.randint(1, 8192)])
            k = rng.randint(q, 32768) if rng.random() < 0.3 else rng.randint(q, max(q, 8192))
            splits = fa3_num_splits(hkv, group, q, k, 64, 64, sms)
            n = -(-k // 64)
            stride = 64 * -(-n // splits) if splits > 1 else 0
            p = select(num_seqs=rng.randint(1, 256), max_seqlen_q=q, max_seqlen_k=k)
            assert (p.kv_tile, p.split_stride) == (STOCK_TILE, stride), (sms, q, k)
