"""The GPU KernelSet's stock selection, which runs on the host (no GPU needed): FlashAttention-3's split count
as Dao-AILab/flash-attention's hopper/heuristics.h computes it, read from the batch, so stock's reduction
order follows the batch (what the battery shows on the device)."""

from __future__ import annotations

from detent_audit.kernels.gpu import fa3_num_splits


def test_fa3_split_count_follows_the_batch() -> None:
    # decode, 8 KV heads x 4 query heads each, 4096 keys in 64-key blocks on 132 SMs: 8 m-blocks in total;
    # efficiency 8s/132 per wave: the first s reaching 0.85 of the best (1.0 at s=33) is 15
    assert fa3_num_splits(8, 4, 1, 4096, 64, 64, 132) == 15
    assert fa3_num_splits(8, 4, 1, 256, 64, 64, 132) == 1        # <= 4 key blocks never split
    assert fa3_num_splits(8, 4, 2048, 4096, 64, 64, 132) == 1    # 1024 m-blocks fill the GPU
    counts = {fa3_num_splits(8, 4, q, k, 64, 64, 132) for q in (1, 4, 16, 64) for k in (300, 1000, 4096, 8192)}
    assert len(counts) > 2  # the split (so the reduction order) changes with the batch's shape

