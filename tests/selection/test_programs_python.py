"""The SelIR programs run as plain Python: every shipped deployment at a grid of runtime points, and known
values of the upstream heuristics (the sources each program's docstring names), computed by hand."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest

from detent_audit.manifests.deployment import load_deployment, shipped_deployments
from detent_audit.selection.lang import SelectionFailure, knob_settings
from detent_audit.selection.programs import (
    FAMILIES,
    FAMILY_ORDER,
    all_reduce,
    embedded,
    fa3,
    families_for,
    gemm,
)
from detent_audit.selection.programs import fused_moe as moe

KiB, MiB = 1024, 1024 * 1024


def dep(name: str):
    return load_deployment(shipped_deployments()[name])


def _points(facts, params: list[str]):
    """Consistent runtime points within the program's bounds (actual counts equal the selection's view)."""
    tokens = getattr(facts, "max_num_batched_tokens", 1)
    ctx = getattr(facts, "max_model_len", 1)
    for num_tokens, seq_k, num_seqs in itertools.product((1, 7, 512, tokens), (1, 300, ctx), (1, 3, 200)):
        num_seqs = min(num_seqs, getattr(facts, "max_num_seqs", num_seqs), num_tokens)
        values = {"num_tokens": num_tokens, "num_tokens_actual": num_tokens, "expert_rows": num_tokens,
                  "num_seqs": num_seqs,
                  "max_seqlen_q": min(num_tokens, getattr(facts, "max_query_len", tokens)),
                  "max_seqlen_k": seq_k, "seqlen_k": seq_k, "total_blocks": num_seqs * (seq_k // 64 + 1),
                  "in_cuda_graph": int(num_tokens <= 160), "common_prefix_len": min(seq_k, 300),
                  "max_kv_pages": max(1, seq_k // 16), "num_q_tiles": num_seqs}
        yield [values[p] for p in params]


@pytest.mark.parametrize("name", sorted(shipped_deployments()))
def test_every_program_runs_on_every_shipped_deployment(name: str) -> None:
    deployment = dep(name)
    specs = families_for(deployment)
    assert [s.name for s in specs] == [f for f in FAMILY_ORDER if f in {s.name for s in specs}]
    for spec in specs:
        facts = spec.facts(deployment)
        params = list(inspect.signature(spec.program).parameters)[1:]
        for args in _points(facts, params):
            try:
                choice = spec.program(facts, *args)
            except SelectionFailure as exc:  # unpinned, a large all-reduce goes to NCCL (by size, or along
                # a channel chain no fact records)
                assert spec.name == "all_reduce" and ("NCCL picks its algorithm" in str(exc)
                                                      or "NCCL sums each element" in str(exc)), exc
                continue
            for field in dataclasses.fields(choice):
                assert isinstance(getattr(choice, field.name), (int, bool, str)), (spec.key, field.name)


def test_registry() -> None:
    assert {s.name for s in FAMILIES.values()} == set(FAMILY_ORDER)
    for key, spec in FAMILIES.items():
        assert key == spec.program.__name__ and spec.program.__selir_family__ == spec.name
    keys = {name: [s.key for s in families_for(dep(name))] for name in shipped_deployments()}
    assert keys["llama-3.1-70b-instruct-tp4-h100-vllm"] == ["fa3_vllm", "all_reduce_vllm", "gemm"]
    assert keys["llama-3.1-70b-instruct-tp4-h100-sglang"] == ["fa3_sglang", "all_reduce_sglang", "gemm"]
    assert keys["qwen3-30b-a3b-tp4-h100-vllm"] == ["fa3_vllm", "fused_moe", "all_reduce_vllm", "gemm"]
    assert keys["llama-3.1-8b-instruct-tp1-h100-vllm"] == ["fa3_vllm", "gemm"]          # TP1: no all-reduce
    assert keys["llama-3.1-8b-instruct-tp1-b200-vllm"] == ["flashinfer_prefill", "gemm"]  # its planner
    assert keys["llama-3.2-1b-tp1-cpu-detent"] == ["embedded_attention", "embedded_gemm"]


# ---- FlashAttention-3 ----

def test_tile_sizes() -> None:
    # hdim 128: paged KV without TMA (or causal) -> kBlockN 128; else 176 upstream, 160 in the vLLM fork
    assert fa3.tile_size_fwd_sm90(128, 128, False, False, 2, True, False) == (128, 128)
    assert fa3.tile_size_fwd_sm90(128, 128, False, False, 2, False, False) == (128, 176)
    assert fa3.tile_size_fwd_sm90_vllm(128, 128, False, False, 2, False, False, False) == (128, 160)
    assert fa3.tile_size_fwd_sm90_vllm(128, 128, False, False, 2, False, False, True) == (64, 176)
    # hdim 64 in the fork: one MMA warpgroup (decode) 64x192; causal otherwise 192x128
    assert fa3.tile_size_fwd_sm90_vllm(64, 64, True, False, 2, True, False, True) == (64, 192)
    assert fa3.tile_size_fwd_sm90_vllm(64, 64, True, False, 2, True, False, False) == (192, 128)
    # hdim 192 / dv 128: 128 with TMA, 96 paged without; dv 192: 112 upstream, 96 in the fork
    assert fa3.tile_size_fwd_sm90(192, 128, False, False, 2, False, False) == (128, 128)
    assert fa3.tile_size_fwd_sm90(192, 128, False, False, 2, True, False) == (128, 96)
    assert fa3.tile_size_fwd_sm90(192, 192, False, False, 2, False, False) == (128, 112)
    assert fa3.tile_size_fwd_sm90_vllm(192, 192, False, False, 2, False, False, False) == (128, 96)
    assert fa3.tile_size_fwd_sm90(256, 256, True, False, 2, True, False) == (128, 80)
    assert fa3.tile_size_fwd_sm90(128, 128, False, False, 1, False, False) == (128, 224)     # FP8


def test_num_splits_heuristic_rules() -> None:
    h = fa3.num_splits_heuristic
    # num_n_blocks <= 4 never splits (hdim 128, seqlen_k 512: 4 blocks of 128), 5 blocks may
    assert h(1, 132, 4, 1, 512 * 256 * 2, True, 128) == 1
    assert h(1, 132, 5, 1, 640 * 256 * 2, True, 128) == 5
    # by hand: 2 m-blocks, 132 SMs, 64 n-blocks: cap 64, best efficiency 128/132 at 64 splits;
    # 55 splits give 110/132 = 0.833 >= 0.85 x 0.970 = 0.824, 54 give 108/132 = 0.818 < 0.824
    assert h(2, 132, 64, 1, 8192 * 256 * 2, True, 128) == 55
    # heuristics.h's own example: 48 blocks on 108 SMs: 2 splits (0.89) within 85% of the best (1.0 at 9)
    assert h(48, 108, 100, 1, 0, True, 128) == 2
    # >= 0.8 x SMs fills the GPU: 106 >= 105.6 -> 1; 105 does not
    assert h(106, 132, 64, 1, 0, True, 128) == 1
    assert h(105, 132, 64, 1, 0, True, 128) > 1
    # the L2 rule: a 120 MiB KV head, >= 2 x SMs m-blocks, not causal -> ceil(120 / 50) = 3 splits
    assert h(300, 132, 1000, 300, 120 * MiB, False, 128) == 3
    assert h(300, 132, 1000, 300, 120 * MiB, True, 128) == 1


def test_should_pack_gqa_by_hand() -> None:
    # 100 queries in 128-row tiles: 100/128 either way, not 0.9x better -> no pack; 1 query x 4 heads: pack
    assert fa3.should_pack_gqa(False, 100, 4, 128) is False
    assert fa3.should_pack_gqa(False, 1, 4, 128) is True
    assert fa3.should_pack_gqa(True, 100, 4, 128) is True


def test_dynamic_split_depends_on_the_whole_batch() -> None:
    d = fa3.facts(dep("llama-3.1-70b-instruct-tp4-h100-vllm"))      # h 16, h_k 2, 132 SMs, graph bound 32
    alone = fa3.fa3_vllm(d, 1, 1, 1, 8192, 64, 8192, 0)
    # a full-graph decode step: 32 static splits; 64 blocks x 1.1 x 2 heads / 132 SMs -> 2 blocks per SM
    assert (alone.block_m, alone.block_n, alone.num_splits) == (64, 128, 32)
    assert (alone.num_splits_dynamic, alone.kv_blocks_per_split) == (32, 2)
    # the same request beside 99 others of 8192 tokens: ceil(6400 x 2.2 / 132) = 107 blocks per SM -> 1 split
    crowded = fa3.fa3_vllm(d, 100, 100, 1, 8192, 6400, 8192, 0)
    assert (crowded.num_splits_dynamic, crowded.kv_blocks_per_split) == (1, 64)
    # outside a CUDA graph the static count is the heuristic's (55, as computed by hand above)
    assert fa3.fa3_vllm(d, 600, 600, 1, 8192, 600 * 64, 8192, 0).num_splits == 55
    # more than 992 sequences: the fork disables splitting
    many = fa3.fa3_vllm(d, 1000, 1000, 1, 8192, 64000, 8192, 0)
    assert (many.num_splits, many.num_splits_dynamic) == (1, 1)


def test_blocks_per_sm_matches_float32_where_float64_does_not() -> None:
    # TP8: h 8, h_k 1 (packed: 1 head). 360 blocks x 1.1 / 132 SMs = 3 exactly, as upstream's float32 gives;
    # float64 rounds 360 x 1.1 up and would give 4. 1280 tokens = 10 blocks -> ceil(10 / 3) = 4 splits
    d = fa3.facts(dep("llama-3.1-70b-instruct-tp8-h100-vllm"))
    assert fa3.fa3_vllm(d, 1, 1, 1, 1280, 360, 1280, 0).num_splits_dynamic == 4


def test_decode_drops_causal_and_moves_the_hdim64_tile() -> None:
    d = fa3.facts(dep("llama-3.2-1b-tp1-h100-vllm"))                # hdim 64, 32 heads / 8 KV heads
    decode = fa3.fa3_vllm(d, 4, 4, 1, 1000, 64, 1000, 0)
    mixed = fa3.fa3_vllm(d, 600, 4, 597, 1000, 64, 1000, 0)
    assert (decode.is_causal, decode.block_m, decode.block_n) == (False, 64, 192)
    assert (mixed.is_causal, mixed.block_m, mixed.block_n) == (True, 192, 128)
    # hdim 128 with paged KV keeps causal in decode, and its kBlockN stays 128
    d128 = fa3.facts(dep("llama-3.1-8b-instruct-tp1-h100-vllm"))
    assert fa3.fa3_vllm(d128, 4, 4, 1, 1000, 64, 1000, 0).is_causal is True
    assert {fa3.fa3_vllm(d128, t, 4, q, 1000, 64, 1000, 0).block_n for t, q in ((4, 1), (600, 597))} == {128}


def test_paged_kv_tma_moves_the_tile() -> None:
    # hdim 192 / dv 128 with 128-token pages: a prefill uses TMA (kBlockN 128), a decode does not (96)
    d = dataclasses.replace(fa3.facts(dep("llama-3.1-8b-instruct-tp1-h100-sglang")), head_dim=192,
                            head_dim_v=128, page_size=128)
    assert fa3.fa3(d, 600, 4, 600, 1000, 64, 1000).block_n == 128
    assert fa3.fa3(d, 4, 4, 1, 1000, 64, 1000).block_n == 96
    # with SGLang's 1-token pages it is never TMA
    d1 = dataclasses.replace(d, page_size=1)
    assert fa3.fa3(d1, 600, 4, 600, 1000, 64, 1000).block_n == 96


def test_split_stride_makes_splits_request_only() -> None:
    d = fa3.facts(dep("llama-3.1-70b-instruct-tp4-h100-vllm"))
    with knob_settings({"attention.split_stride": 1024}):
        alone = fa3.fa3_vllm(d, 1, 1, 1, 3000, 24, 3000, 0)
        crowded = fa3.fa3_vllm(d, 100, 100, 1, 8000, 6400, 3000, 0)
    # 3000 tokens = 24 blocks of 128; 1024 tokens = 8 blocks per split -> 3 splits, whatever the batch
    for choice in (alone, crowded):
        assert (choice.num_splits_dynamic, choice.kv_blocks_per_split, choice.split_stride) == (3, 8, 1024)
    assert (alone.num_splits, crowded.num_splits) == (3, 8)          # the accumulator bound: longest sequence


def test_engine_num_splits_arguments() -> None:
    # SGLang passes 0 in and out of graphs: the heuristic; vLLM batch-invariant passes 1
    sgl = fa3.facts(dep("llama-3.1-70b-instruct-tp4-h100-sglang"))
    assert fa3.fa3(sgl, 1, 1, 1, 8192, 64, 8192).num_splits == 55
    bi = fa3.facts(dep("qwen3-1.7b-tp1-h100-vllm-bi"))
    assert {fa3.fa3_vllm(bi, t, 1, 1, 8192, 64, 8192, 0).num_splits for t in (1, 600)} == {1}


# ---- fused MoE ----

def test_moe_nearest_row_and_ties_go_to_the_smaller_key() -> None:
    d = moe.facts(dep("qwen3-30b-a3b-tp4-h100-vllm"))
    row = moe.fused_moe
    assert row(d, 1).block_size_k == 64 and row(d, 1).group_size_m == 1
    assert (row(d, 20).num_warps, row(d, 20).group_size_m) == (8, 1)       # 16 and 24 tie: key 16
    assert row(d, 40).block_size_k == 128                                  # 32 and 48 tie: key 32 (K 128)
    assert row(d, 41).block_size_k == 64                                   # nearest 48
    assert (row(d, 8192).block_size_m, row(d, 8192).num_warps) == (128, 4)  # above the table: key 4096
    assert row(d, 1800).block_size_n == 256 and row(d, 1792).block_size_n == 256  # 1536 | 2048: both N 256
    assert row(d, 1).combine == "moe_sum"


def test_moe_default_config_and_sglang_combine_switch() -> None:
    d = dataclasses.replace(moe.facts(dep("qwen3-30b-a3b-tp4-h100-vllm")), has_table=False)
    small, large = moe.fused_moe(d, 128), moe.fused_moe(d, 129)            # M <= E = 128
    assert (small.block_size_m, small.block_size_n, small.block_size_k, small.group_size_m) == (16, 32, 64, 1)
    assert (large.block_size_m, large.block_size_n, large.block_size_k, large.group_size_m) == (64, 64, 32, 8)
    bi = dataclasses.replace(d, batch_invariant=True)
    assert {(c.block_size_m, c.block_size_k)
            for c in (moe.fused_moe(bi, 1), moe.fused_moe(bi, 8000))} == {(64, 32)}
    sgl = dataclasses.replace(d, sum_switch_tokens=32, sum_impl="moe_sum_reduce")
    combines = (moe.fused_moe(sgl, 32).combine, moe.fused_moe(sgl, 33).combine)
    assert combines == ("torch_compile_sum", "moe_sum_reduce")
    assert moe.fused_moe(dataclasses.replace(sgl, batch_invariant=True), 5).combine == "moe_sum_reduce"
    assert moe.fused_moe(dataclasses.replace(sgl, top_k=2), 5).combine == "add"


# ---- all-reduce ----

def _ar(d, tokens: int):
    return tuple(all_reduce.all_reduce_vllm(d, tokens, tokens).path.split("/"))


def test_vllm_nccl_symm_mem_bands() -> None:
    d = all_reduce.facts(dep("llama-3.1-70b-instruct-tp4-h100-vllm"))
    # 16 bytes a token, so token counts are byte counts / 16; ws 4: <= 16 KiB or >= 512 KiB
    d = dataclasses.replace(d, nccl_symm_mem=True, hidden_size=8, max_num_batched_tokens=65536,
                            nccl_path="nccl/allreduce:tree.Simple.1ch", nccl_chain_order="recorded")
    assert _ar(d, 16 * KiB // 16)[0] == "nccl_symm_mem"
    assert _ar(d, 16 * KiB // 16 + 1)[0] == "custom"
    assert _ar(d, 512 * KiB // 16 - 1)[0] == "custom"
    assert _ar(d, 512 * KiB // 16)[0] == "nccl_symm_mem"
    d8 = dataclasses.replace(d, world_size=8)                              # ws 8: <= 16 KiB or >= 128 KiB
    assert [_ar(d8, n)[0] for n in (1024, 1025, 8191, 8192)] == ["nccl_symm_mem", "custom", "custom",
                                                                 "nccl_symm_mem"]
    assert _ar(dataclasses.replace(d, world_size=2), 1)[0] == "custom"     # below 4 GPUs: never


def test_vllm_custom_all_reduce_cap_is_strict_and_algorithm_by_bytes() -> None:
    d = all_reduce.facts(dep("llama-3.1-70b-instruct-tp4-h100-vllm"))    # 16 KiB a token, cap 8 MiB
    assert _ar(d, 31) == ("custom", "1stage")                              # 496 KiB < 512 KiB
    assert _ar(d, 32) == ("custom", "2stage")                              # 512 KiB
    assert _ar(d, 511) == ("custom", "2stage")
    assert _ar(d, 512) == ("torch_symm_mem", "multimem")                   # 8 MiB is not < 8 MiB
    with knob_settings({"all_reduce.max_size": 16777216}):
        assert _ar(d, 512) == ("custom", "2stage")
    d8 = all_reduce.facts(dep("llama-3.1-70b-instruct-tp8-h100-vllm"))   # table cap 256 KiB at ws 8
    assert _ar(d8, 15) == ("custom", "1stage")
    assert _ar(d8, 16) == ("torch_symm_mem", "multimem")
    assert _ar(d8, 4096) == ("torch_symm_mem", "multimem")                # 64 MiB <= 64 MiB
    with pytest.raises(SelectionFailure, match="NCCL picks its algorithm"):
        _ar(d8, 4097)                                                      # NCCL by size: not legal
    pinned = dataclasses.replace(d8, nccl_path="nccl/allreduce:tree.Simple.8ch")
    with pytest.raises(SelectionFailure, match="NCCL sums each element"):
        _ar(pinned, 4097)                                                  # pinned, but no chain order
    chained = dataclasses.replace(pinned, nccl_chain_order="recorded")
    assert _ar(chained, 4097) == ("nccl", "allreduce:tree.Simple.8ch")
    bi = dataclasses.replace(d, batch_invariant=True, custom_ar_algo="1stage", torch_symm_mem=False)
    assert {_ar(bi, n) for n in (1, 512, 8192)} == {("custom", "1stage")}


def test_sglang_v2_thresholds_by_context() -> None:
    d = all_reduce.facts(dep("llama-3.1-70b-instruct-tp4-h100-sglang"))   # 16 KiB a token, ws 4
    pick = all_reduce.all_reduce_sglang
    assert pick(d, 56, 0, 56).path == "custom/1shot_push"                  # 896 KiB eagerly
    assert pick(d, 57, 0, 57).path == "custom/2shot_pull_mc"
    assert pick(d, 24, 1, 24).path == "custom/1shot_push"                  # 384 KiB in a CUDA graph
    assert pick(d, 25, 1, 25).path == "custom/2shot_pull"
    assert pick(d, 1024, 1, 1024).path == "custom/2shot_pull"              # 16 MiB, the workspace cap
    with pytest.raises(SelectionFailure, match="NCCL sums each element"):
        pick(d, 1025, 1, 1025)                       # the file pins NCCL but records no chain order
    chained = dataclasses.replace(d, nccl_chain_order="recorded")
    assert pick(chained, 1025, 1, 1025).path == d.nccl_path == "nccl/allreduce:tree.Simple.8ch"
    with pytest.raises(SelectionFailure, match="NCCL picks its algorithm"):
        pick(dataclasses.replace(d, nccl_path=""), 1025, 1, 1025)


# ---- GEMM ----

def test_gemm_m_buckets_keep_block_k() -> None:
    d = gemm.facts(dep("qwen3-1.7b-tp1-h100-vllm-bi"))                   # every projection tuned (hopper)
    one, five, big = gemm.gemm(d, 1, 1), gemm.gemm(d, 5, 5), gemm.gemm(d, 3000, 3000)
    assert (one.backend, one.m_bucket, one.qkv_block_m, one.qkv_block_n) == ("triton", 1, 16, 64)
    assert (five.m_bucket, five.qkv_block_m, five.qkv_block_n) == (8, 16, 128)
    assert (big.m_bucket, big.qkv_block_m, big.qkv_block_n) == (2048, 64, 64)   # above the range: the last
    assert {c.qkv_block_k for c in (one, five, big)} == {128}
    assert (big.mlp_in_block_m, big.mlp_in_block_n) == (128, 256)                # gate_up (12288, 2048)
    with knob_settings({"gemm.pad_rows": 64}):
        assert gemm.gemm(d, 5, 5).m_bucket == 64


def test_gemm_cublas_and_untuned_shapes() -> None:
    d = gemm.facts(dep("llama-3.1-70b-instruct-tp4-h100-vllm"))
    stock = gemm.gemm(d, 5, 5)
    assert (stock.backend, stock.cublas_m, stock.m_bucket) == ("cublas", 5, 0)
    with knob_settings({"gemm.backend": "triton", "gemm.pad_rows": 256}):
        triton = gemm.gemm(d, 5, 5)
    assert (triton.backend, triton.cublas_m, triton.qkv_block_m, triton.qkv_block_n, triton.qkv_block_k) == (
        "triton", 0, 128, 128, 64)
    with knob_settings({"gemm.pad_rows": 256}):
        assert gemm.gemm(d, 5, 5).cublas_m == 256


# ---- embedded engine ----

def test_embedded_programs() -> None:
    d = dataclasses.replace(embedded.facts(dep("llama-3.2-1b-tp1-cpu-detent")), num_cores=64)
    assert [embedded.embedded_gemm(d, n).chunk_rows for n in (3, 300)] == [3, 300]   # stock: the whole batch
    with knob_settings({"embedded.gemm.chunk_rows": 16}):
        assert {embedded.embedded_gemm(d, n).chunk_rows for n in (3, 300)} == {16}
    # stock attention: 64 cores / (1 seq x 8 KV heads) = 8 splits; 8 sequences -> 1 split
    alone = embedded.embedded_attention(d, 1, 4096, 4096)
    crowded = embedded.embedded_attention(d, 8, 4096, 4096)
    assert (alone.num_splits, alone.tiles_per_split) == (8, 8)
    assert (crowded.num_splits, crowded.tiles_per_split) == (1, 64)
    with knob_settings({"embedded.attention.split_stride": 1024}):
        choices = {embedded.embedded_attention(d, s, 4096, 4096) for s in (1, 8)}
    assert {(c.num_splits, c.tiles_per_split) for c in choices} == {(4, 16)}
    assert embedded.embedded_moe(d, 9).chunk_rows == 9
