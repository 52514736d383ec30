"""Stock mode's attention split on a GPU is FlashAttention-3's heuristic as its SelIR program computes it
(selection/programs/fa3.py), evaluated per launch on the batch; it runs on the host, so no GPU is needed."""

from __future__ import annotations

from detent_audit.runtime.kernel_select import STOCK_TILE, engine_deployment, stock_attention_selector
from detent_audit.runtime.model_config import NAMED_SHAPES


def selector(shape: str = "llama-3.1-8b", sms: int = 132):
    dep = engine_deployment(NAMED_SHAPES[shape], dtype="bfloat16", num_threads=1, block_size=16,
                            max_model_len=32768, max_num_seqs=256, max_num_batched_tokens=8192,
                            prefix_caching=True, batch_invariant=False)
    return stock_attention_selector(dep, sms)


def stride(select, q: int, k: int, num_seqs: int = 1) -> int:
    p = select(num_seqs=num_seqs, max_seqlen_q=q, max_seqlen_k=k)
    assert p.kv_tile == STOCK_TILE
    return p.split_stride


def test_the_split_count_is_fa3s_and_follows_the_batch() -> None:
    select = selector()  # Llama-3.1-8B: 8 KV heads x 4 query heads each, on 132 SMs
    # decode over 4096 keys in 64-key tiles: 8 m-blocks in all; the efficiency 8s/132 per wave reaches 0.85 of
    # the best (1.0 at s = 33) first at s = 15: the 64 tiles cut into runs of 5
    assert stride(select, 1, 4096) == 5 * STOCK_TILE
    assert stride(select, 1, 256) == 0      # 4 key tiles or fewer never split
    assert stride(select, 2048, 4096) == 0  # 1024 m-blocks fill the GPU
    strides = {stride(select, q, k) for q in (1, 4, 16, 64) for k in (300, 1000, 4096, 8192)}
    assert len(strides) > 2  # the split (so the reduction order) changes with the batch's shape
    assert stride(selector(sms=16), 1, 4096) != 5 * STOCK_TILE  # and with the device
    # varlen: FA3 counts the batch as one sequence, so the number of sequences does not move it
    assert {stride(select, 1, 4096, n) for n in (1, 7, 256)} == {5 * STOCK_TILE}


def test_split_boundaries_are_whole_tiles_and_cover_the_longest_sequence() -> None:
    select = selector("qwen3-30b-a3b", 78)
    for k in range(1, 32768, 97):
        p = select(num_seqs=3, max_seqlen_q=1, max_seqlen_k=k)
        assert p.split_stride % STOCK_TILE == 0
        assert p.split_stride == 0 or -(-k // p.split_stride) <= 128
