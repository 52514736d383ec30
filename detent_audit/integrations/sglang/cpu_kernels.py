"""Detent mode on a CPU: SGLang's batch-variant kernels replaced by detent's, through SGLang's hook registry.

SGLang on a CPU (`--device cpu --attention-backend torch_native`, no sgl-kernel) runs F.linear and a
torch.matmul LM head on the whole batch, per-request SDPA over gathered KV, fp32 F.silu, and samples from
temperature-scaled probabilities with the global generator. Measured on SmolLM2-135M (benchmarks/RESULTS.md,
"SGLang"): co-batching and prefix hits change greedy logprob bits. The hooks (targets in `TARGETS`):

- every unquantized linear and the LM head: detent's GEMM (kernels/gemm.py) in the form and rows of the
  compiled `embedded.gemm` selector (the pad or row form only where `kernels/gemm_probe.py` proved it on this
  CPU, `selection.py`, on every shape of the model before the scheduler serves; a product of any other
  shape is proven before its first call computes it); the LM head in fp32;
- attention of the torch_native backend: detent's paged attention, in C (kernels/attention_c.py) or in torch
  (kernels/attention.py), whose KV tiles and splits sit at absolute positions, so prefill, chunked prefill,
  decode and a prefix hit reduce in one order;
  SGLang's KV pool has one token per page, so its `req_to_token` rows are the block tables of 1-token blocks;
- SiLU-and-mul: detent's row-local form (fp32 F.silu's bits depend on the tensor's size, kernels/rowlocal.py),
  in C under the portable ISA setting (kernels/rowlocal_c.py: torch's exp chooses code by the CPU); with the
  GEMM's `fixed` form and the C attention, no product or exp of the forward is then the CPU's choice (RMSNorm
  and RoPE are SGLang's torch forms on a CPU without sgl-kernel, docs/isa.md);
- the sampler: counter-hash sampling (kernels/sampling.py: the draw depends on seed, position and vocabulary
  index only) and logprobs of the raw logits in fp32; every request's seed reaches the sampler
  (SGLang fills `sampling_seed` only in its deterministic mode, which refuses the CPU backends).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from detent_audit.kernels import KernelSet, SelectorError, gemm_probe
from detent_audit.kernels.attention import AttentionMetadata, paged_attention
from detent_audit.kernels.gemm import linear
from detent_audit.kernels.params import GemmParams
from detent_audit.kernels.rowlocal import log_softmax
from detent_audit.kernels.sampling import sample

TARGETS = (
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply",
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head",
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.init_forward_metadata",
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
    "sglang.srt.layers.activation.SiluAndMul.forward_native",
    "sglang.srt.layers.sampler.Sampler.forward",
    "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
)


# after the model is loaded: its RoPE tables in the C order (the portable setting)
ROPE_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"


def fixed_order_rope_tables(result: Any, runner: Any) -> Any:
    """After `ModelRunner.load_model`: every RoPE table of the model recomputed with the C cos and sin
    (torch's are MKL's, which choose code by the CPU past angles of about 1e4). A RoPE whose class builds its
    table its own way (scaled variants) is refused: the scheduler stops before it serves."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    from detent_audit.kernels.rowlocal import rewrite_rope_tables

    rewrite_rope_tables(runner.model, RotaryEmbedding, "SGLang")
    return result


class CpuHooks:
    """The hook functions, closed over one KernelSet (the compiled selectors with the committed tuple)."""

    def __init__(self, kernels: KernelSet, attention: str = "c",
                 proven_shapes: Iterable[tuple[int, int]] = ()) -> None:
        self.kernels = kernels
        self.attention = paged_attention
        if attention == "c":
            from detent_audit.kernels import attention_c

            attention_c.library()  # built (or refused, with the compiler's message) before the first step
            self.attention = attention_c.paged_attention
        self._proven: set[tuple] = set()  # (params, N, K, dtype, threads) the GEMM probe proved here
        # the model's shapes, proven at start by the selection (`selection.cpu_selection`) in the tuple's form
        params = kernels.select_gemm(num_tokens=1)
        if params is not None and params.form != "chunk":
            threads = torch.get_num_threads()
            self._proven.update((params, n, k, torch.float32, threads) for n, k in proven_shapes)

    def hooks(self) -> dict[str, tuple[str, Any]]:
        """target -> (hook type name, hook); under the portable setting, the RoPE tables' (`ROPE_TARGET`)."""
        fns = (self.linear_apply, self.lm_head, self.init_forward_metadata, self.forward_extend,
               self.forward_decode, self.silu_and_mul, self.sampler_forward, self.with_seeds)
        kinds = ("REPLACE",) * 7 + ("AFTER",)
        out = {t: (k, f) for t, k, f in zip(TARGETS, kinds, fns, strict=True)}
        if self.kernels.fixed_order:
            out[ROPE_TARGET] = ("AFTER", fixed_order_rope_tables)
        return out

    # ---- GEMM
    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        params = self.kernels.select_gemm(num_tokens=max(rows, 1))
        if params is None:  # detent's selectors always return params (the kernel set refuses otherwise)
            raise SelectorError("the GEMM selector returned no params in the SGLang plugin")
        if params.form != "chunk":
            self._prove(params, weight)
        return linear(x, weight, bias, params=params)

    def _prove(self, params: GemmParams, weight: torch.Tensor) -> None:
        """The pad and row forms rest on the BLAS: a weight shape they were not proven on at start (none of
        the model's) is proven now, before its first product, once (`GemmFormNotInvariant` where it fails:
        SGLang's scheduler then stops, serving nothing)."""
        # a new thread count is proven anew
        key = (params, *weight.shape, weight.dtype, torch.get_num_threads())
        if key not in self._proven:
            gemm_probe.require(params, [tuple(weight.shape)], weight.dtype,
                               what=f"the tuple's ({params.label})")
            self._proven.add(key)

    def linear_apply(self, method: Any, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None):
        return self._linear(x, layer.weight, bias)

    def lm_head(self, processor: Any, hidden_states: torch.Tensor, lm_head: Any,
                embedding_bias: torch.Tensor | None = None) -> torch.Tensor:
        # logits in fp32 whatever the model dtype: the logprobs a receipt signs are fp32
        return self._linear(hidden_states.float(), lm_head.weight.float(),
                            None if embedding_bias is None else embedding_bias.float())

    def silu_and_mul(self, op: Any, x: torch.Tensor) -> torch.Tensor:
        # the C form under the portable setting (`KernelSet.fixed_order`), else the row-local torch form
        return self.kernels.silu_and_mul(x)

    # ---- attention (torch_native backend)
    def init_forward_metadata(self, backend: Any, forward_batch: Any) -> None:
        backend.swa_out_cache_loc = None
        backend.forward_metadata = _metadata(backend, forward_batch)

    def forward_extend(self, backend: Any, q, k, v, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True):
        return self._attend(backend, q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, backend: Any, q, k, v, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True):
        return self._attend(backend, q, k, v, layer, forward_batch, save_kv_cache)

    def _attend(self, backend: Any, q, k, v, layer: Any, forward_batch: Any, save_kv_cache: bool):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        if layer.is_cross_attention or layer.qk_head_dim != layer.v_head_dim or (
                layer.sliding_window_size is not None and layer.sliding_window_size > -1):
            raise NotImplementedError("detent's SGLang attention covers causal decoder self-attention "
                                      "without a sliding window")
        pool = backend.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        meta = backend.forward_metadata
        if not isinstance(meta, AttentionMetadata):
            meta = _metadata(backend, forward_batch)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        k_cache = pool.get_key_buffer(layer.layer_id)  # [slots, Hkv, D]
        v_cache = pool.get_value_buffer(layer.layer_id)
        params = self.kernels.select_attention(num_seqs=meta.num_seqs, max_seqlen_q=meta.max_seqlen_q,
                                               max_seqlen_k=meta.max_seqlen_k)
        out = self.attention(q.reshape(-1, heads, dim).float(), k_cache.unsqueeze(1), v_cache.unsqueeze(1),
                             meta, scale=layer.scaling, params=params)
        return out.reshape(-1, heads * dim).to(q.dtype)

    # ---- sampling
    def with_seeds(self, info: Any, cls: Any, batch: Any, vocab_size: int) -> Any:
        """After SamplingBatchInfo.from_schedule_batch: every request's seed (0 for greedy ones, unused)."""
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        info.sampling_seed = torch.tensor([0 if s is None else s for s in seeds], dtype=torch.int64,
                                          device=info.temperatures.device)
        return info

    def sampler_forward(self, sampler: Any, logits_output: Any, sampling_info: Any, return_logprob: bool,
                        top_logprobs_nums: list[int], token_ids_logprobs: list, positions: torch.Tensor):
        logits = sampler._preprocess_logits(logits_output.next_token_logits, sampling_info).float()
        rows = list(range(logits.shape[0]))
        ids = sampling_rows(logits, sampling_info, rows, positions.to(torch.int64).view(-1))
        if return_logprob:
            result = sampler.output_logprob_processor.compute_logprobs(
                log_softmax(logits), top_logprobs_nums, token_ids_logprobs, ids)
            result.write_output_to(logits_output)
        return ids


def sampling_rows(logits: torch.Tensor, sampling_info: Any, requests: list[int],
                  positions: torch.Tensor) -> torch.Tensor:
    """The counter-hash draw of each row of `logits` ([rows, vocab] fp32) with the sampling of batch request
    `requests[row]` (SGLang's `SamplingBatchInfo`: temperature, top-k, top-p, the seed `with_seeds` set) at
    absolute `positions[row]`: the sampler's draw, and a rescore's at each position it scores
    (`rescore.py`). A batch SGLang marks all greedy draws the argmax."""
    batch = sampling_info.temperatures.shape[0]
    index = torch.tensor(requests, dtype=torch.int64)
    temperature = sampling_info.temperatures.view(-1).float()
    seeds = sampling_info.sampling_seed
    if seeds is None or seeds.shape[0] != batch:
        seeds = torch.zeros(batch, dtype=torch.int64)
    if bool(sampling_info.is_all_greedy):
        temperature = torch.zeros(batch)
    top_k = sampling_info.top_ks.to(torch.int64)
    top_k = torch.where(top_k >= logits.shape[-1], 0, top_k).clamp(min=0)  # SGLang's "off" is a huge k
    return sample(logits, temperature[index], top_k[index], sampling_info.top_ps.float()[index], seeds[index],
                  positions)


def _metadata(backend: Any, forward_batch: Any) -> AttentionMetadata:
    """The step's batch as detent's attention metadata: 1-token blocks, req_to_token rows as block tables."""
    seq_lens = forward_batch.seq_lens.to(torch.int64).cpu()
    num_seqs = seq_lens.shape[0]
    if forward_batch.forward_mode.is_decode():
        query_lens = torch.ones(num_seqs, dtype=torch.int64)
    else:
        query_lens = forward_batch.extend_seq_lens.to(torch.int64).cpu()
    context = seq_lens - query_lens
    max_k = int(seq_lens.max()) if num_seqs else 0
    rows = forward_batch.req_pool_indices.to(torch.int64)
    tables = backend.req_to_token_pool.req_to_token[rows, :max(max_k, 1)]
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    cu[1:] = query_lens.cumsum(0)
    return AttentionMetadata(cu_seqlens_q=cu, context_lens=context, seq_lens=seq_lens,
                             block_tables=tables.to(torch.int64),
                             slot_mapping=forward_batch.out_cache_loc.to(torch.int64),
                             max_seqlen_q=int(query_lens.max()) if num_seqs else 0, max_seqlen_k=max_k)
