"""The CUDA selection points, checked on CPU by calling vLLM's own functions with the pins installed: for
every batch in a random sample, the fused-MoE config and FlashAttention's scheduled split count are the
pinned values; without the pins they follow the batch (so the check can fail)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from detent_audit.integrations.vllm import cuda  # noqa: E402


@pytest.fixture(autouse=True)
def _unpin():
    yield
    cuda.unpin_all()


def test_fused_moe_config_is_the_pinned_row_for_every_m() -> None:
    from vllm.model_executor.layers.fused_moe import fused_moe

    w1, w2 = (64, 2 * 768, 2048), (64, 2048, 768)  # 64 experts, hidden 2048, intermediate 768
    sample = random.Random(0).sample(range(1, 8193), 40)
    stock = {json_key(fused_moe.try_get_optimal_moe_config(w1, w2, 8, None, m)) for m in sample}
    assert len(stock) > 1  # vLLM's own choice reads M
    pinned = cuda.pin_fused_moe(w1, w2, 8, None, pinned_m=64)
    for m in sample:
        assert fused_moe.try_get_optimal_moe_config(w1, w2, 8, None, m) == pinned
    cuda.unpin_all()
    assert len({json_key(fused_moe.try_get_optimal_moe_config(w1, w2, 8, None, m)) for m in sample}) > 1


def json_key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


def test_flash_attention_schedules_the_pinned_split_count_for_every_batch(monkeypatch) -> None:
    from vllm.v1.attention.backends import flash_attn

    seen: list[int] = []
    # CUDA-only import
    monkeypatch.setattr(flash_attn, "get_scheduler_metadata",
                        lambda **kw: seen.append(kw["num_splits"]) or torch.zeros(1), raising=False)
    builder = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"), kv_cache_dtype=torch.bfloat16,
                              num_heads_q=32, dcp_world_size=1, num_heads_kv=8, headdim=128, block_size=16,
                              aot_sliding_window=None)
    rng = random.Random(1)
    batches = []
    for _ in range(30):
        n = rng.randint(1, 64)
        lens = torch.tensor([rng.randint(1, 4000) for _ in range(n)], dtype=torch.int32)
        # what build() passes: 0 (FA3's heuristic) above the capture size, the graph bound below it
        batches.append((n, lens, rng.choice((0, 16, 32))))

    def schedule(n, lens, splits):
        return flash_attn.FlashAttentionMetadataBuilder._get_scheduler_metadata(
            builder, aot_schedule=True, batch_size=n, cu_query_lens=torch.arange(n + 1, dtype=torch.int32),
            max_query_len=1, seqlens=lens, max_seq_len=int(lens.max()), causal=True, max_num_splits=splits)

    for batch in batches:
        schedule(*batch)
    assert set(seen) == {0, 16, 32}  # unpinned: the split count build() chose
    seen.clear()
    cuda.pin_flash_attention(1)
    for batch in batches:
        schedule(*batch)
    assert seen == [1] * len(batches)


def test_flash_attention_metadata_carries_the_pinned_split_count() -> None:
    from vllm.v1.attention.backends import flash_attn

    made = SimpleNamespace(max_num_splits=0)
    original = flash_attn.FlashAttentionMetadataBuilder.build
    flash_attn.FlashAttentionMetadataBuilder.build = lambda self, *a, **k: made
    try:
        cuda.pin_flash_attention(1)
        for splits in (0, 16, 32):
            made.max_num_splits = splits
            assert flash_attn.FlashAttentionMetadataBuilder.build(None, 0, None).max_num_splits == 1
        cuda.unpin_all()
    finally:
        flash_attn.FlashAttentionMetadataBuilder.build = original
    with pytest.raises(ValueError):
        cuda.pin_flash_attention(0)
