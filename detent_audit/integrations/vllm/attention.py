"""vLLM's CPU attention backend with the project's batch-invariant paged attention inside.

`DetentCPUAttentionBackend` is vLLM's `CPUAttentionBackend` (same name, block sizes, metadata builder) whose
impl, when the engine was built in detent mode, stores K/V itself and runs `KernelSet.attention`: every query
token at absolute position p reduces over KV tiles [j*tile, (j+1)*tile) and splits aligned to absolute
positions, so its bits do not depend on the batch, the step's query count, chunking or a prefix-cache hit.
vLLM's own kernel (`cpu_attention_with_kv_cache`) splits KV by the batch at 2 threads and by the step's
query count past ~256 context tokens at 1 thread.

KV layout: vLLM hands each layer one contiguous tensor `[num_blocks, Hkv, block_size, 2*D]`; only this impl
reads or writes it, so it is taken as `[2, num_blocks, block_size, Hkv, D]` (K then V), the layout of
`kernels.attention_metadata`. Block ids and slots are vLLM's.
The attention itself is the C form (`kernels/attention_c.py`: every operation's order written out, compiled
here) unless the engine asked for the torch form (`kernels/attention.py`); the facts name which.
Supported: decoder self-attention, no ALiBi, sliding window, soft cap, sinks or fp8 KV (refused otherwise).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from detent_audit.integrations.vllm import plugin
from detent_audit.kernels.attention import paged_attention
from detent_audit.kernels.attention_metadata import AttentionMetadata


def kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cache tensor as (k_cache, v_cache), each [num_blocks, block_size, Hkv, D] (views, no
    copy)."""
    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise RuntimeError("the detent CPU attention needs a contiguous KV cache tensor per layer")
    both = kv_cache.view(2, num_blocks, block_size, kv_heads, two_d // 2)
    return both[0], both[1]


class DetentCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl; in detent mode, `forward` and `do_kv_cache_update` are the project's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.detent = plugin.active()
        if not self.detent:
            return
        unsupported = [what for what, present in (
            ("non-decoder attention", self.attn_type != AttentionType.DECODER),
            ("ALiBi", self.alibi_slopes is not None), ("a sliding window", self.sliding_window != -1),
            ("a logits soft cap", bool(self.logits_soft_cap)), ("attention sinks", self.sinks is not None),
            ("an fp8 KV cache", self.is_fp8_kv_cache)) if present]
        if unsupported:
            raise NotImplementedError(f"the detent CPU attention does not support {', '.join(unsupported)}")
        self.kernels = plugin.kernel_set()
        self.c_attention = None
        if plugin.attention_choice() == "c":
            from detent_audit.kernels import attention_c

            attention_c.library()  # built (or refused, with the compiler's message) before the first step
            self.c_attention = attention_c.paged_attention

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self.detent:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        k_cache, v_cache = kv_views(kv_cache)
        n = key.shape[0]
        self.kernels.write_kv(key.view(n, self.num_kv_heads, self.head_size),
                              value.view(n, self.num_kv_heads, self.head_size), k_cache, v_cache,
                              slot_mapping[:n])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not self.detent:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the detent CPU "
                                      "attention")
        if attn_metadata is None:  # warm-up
            return output
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = kv_views(kv_cache)
        meta, params, positions = self._step(attn_metadata, k_cache.shape[1])
        q = query[:n].reshape(n, self.num_heads, self.head_size)
        if self.c_attention is None:  # the torch form the facts name, under the portable setting too
            out = paged_attention(q, k_cache, v_cache, meta, scale=self.scale, params=params)
        else:
            out = self.c_attention(q, k_cache, v_cache, meta, scale=self.scale, params=params,
                                   positions=positions)
        output[:n].copy_(out.reshape(output[:n].shape))
        return output

    def _step(self, attn_metadata, block_size: int) -> tuple:
        """The step's batch as the kernels read it, its selected params and token positions: built by the
        first layer of a step and reused by the others (vLLM passes every layer the same metadata object)."""
        cached = _STEP[0]
        if cached is not None and cached[0] is attn_metadata and cached[1] == block_size:
            return cached[2]
        n = attn_metadata.num_actual_tokens
        seq_lens = attn_metadata.seq_lens.to(torch.int64)
        cu = attn_metadata.query_start_loc[: seq_lens.shape[0] + 1].to(torch.int64)
        meta = AttentionMetadata(
            cu_seqlens_q=cu, context_lens=seq_lens - cu.diff(), seq_lens=seq_lens,
            block_tables=attn_metadata.block_table, slot_mapping=attn_metadata.slot_mapping[:n],
            max_seqlen_q=attn_metadata.max_query_len, max_seqlen_k=attn_metadata.max_seq_len)
        params = self.kernels.select_attention(num_seqs=meta.num_seqs, max_seqlen_q=meta.max_seqlen_q,
                                               max_seqlen_k=meta.max_seqlen_k)
        positions = None
        if self.c_attention is not None:
            from detent_audit.kernels import attention_c

            positions = attention_c.token_positions(meta, block_size)
        # the metadata object is held with its derived values, so its id cannot be reused while cached
        _STEP[0] = (attn_metadata, block_size, (meta, params, positions))
        return meta, params, positions


_STEP: list = [None]  # (vLLM's metadata object, block size, what `_step` derived from it)


class DetentCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[DetentCPUAttentionImpl]:
        return DetentCPUAttentionImpl
