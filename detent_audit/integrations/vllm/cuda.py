"""CUDA selection points of vLLM (0.32/0.33 source), pinned so that no choice reads the batch.

Written against vLLM's source and checked on CPU by calling vLLM's own functions with the pins installed
(tests/integrations/test_vllm_cuda_pins.py); none of it has run on a GPU here, so no CUDA figure is claimed.
- FlashAttention (`vllm/v1/attention/backends/flash_attn.py`): `FlashAttentionMetadataBuilder.build()` picks
  `max_num_splits` inline (0, FA3's heuristic, above the CUDA-graph capture size; the graph bound below it)
  and hands it to `_get_scheduler_metadata`. Both are pinned: `_get_scheduler_metadata` always schedules with
  the pinned split count and `build()`'s metadata carries it, for every batch.
- Fused MoE (`vllm/model_executor/layers/fused_moe`): `try_get_optimal_moe_config` takes the tuned row nearest
  the batch's M unless `get_config()` returns an override; the pin installs, as that override, the config of
  the row the tuple names (`pinned_m`), so every M runs one config.
- All-reduce and cascade: the engine arguments that take the batch-dependent choices away
  (`disable_custom_all_reduce`, no symmetric-memory or FlashInfer all-reduce) are `ENGINE_ARGS`/`ENV`;
  cascade attention was removed from vLLM by 0.32 (recorded as off in the facts).
Every pin restores vLLM's function on `unpin_all()` (tests).
"""

from __future__ import annotations

import functools
from typing import Any

ENGINE_ARGS = {"disable_custom_all_reduce": True}
ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_USE_NCCL_SYMM_MEM": "0",
       "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}

_restore: list[tuple[Any, str, Any]] = []


def _replace(owner: Any, name: str, value: Any) -> None:
    _restore.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def unpin_all() -> None:
    while _restore:
        owner, name, value = _restore.pop()
        setattr(owner, name, value)


def pin_flash_attention(num_splits: int) -> None:
    """FA's split count for every batch: `num_splits` (1 is the only value FA3 keeps batch-independent)."""
    if num_splits < 1:
        raise ValueError(f"a pinned split count is >= 1, got {num_splits}")
    from vllm.v1.attention.backends import flash_attn

    builder = flash_attn.FlashAttentionMetadataBuilder
    schedule, build = builder._get_scheduler_metadata, builder.build

    @functools.wraps(schedule)
    def pinned_schedule(self: Any, **kwargs: Any) -> Any:
        return schedule(self, **{**kwargs, "max_num_splits": num_splits})

    @functools.wraps(build)
    def pinned_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        metadata = build(self, *args, **kwargs)
        metadata.max_num_splits = num_splits
        return metadata

    _replace(builder, "_get_scheduler_metadata", pinned_schedule)
    _replace(builder, "build", pinned_build)


def pin_fused_moe(w1_shape: tuple[int, ...], w2_shape: tuple[int, ...], top_k: int, dtype: str | None,
                  pinned_m: int, block_shape: list[int] | None = None) -> dict[str, int]:
    """Install, as vLLM's fused-MoE config override, the config vLLM itself chooses at M = `pinned_m`
    (the tuple's row); returns it."""
    import vllm.model_executor.layers.fused_moe as fused_moe_pkg
    from vllm.model_executor.layers.fused_moe import fused_moe

    config = dict(fused_moe.try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, pinned_m,
                                                       block_shape))
    _replace(fused_moe_pkg, "_config", config)
    return config
