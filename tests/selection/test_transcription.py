"""The programs say what the engines do: NCCL only on a pinned path with its chain order recorded, detent's
ordered all-reduce, SGLang's all-reduce as one value, SGLang's FA3 build (sgl-attn @ f20a5232) and its
page-table seqlen_k, vLLM's cascade attention, the MoE switches, FlashInfer's planner. Each test fails on a
transcription that misses the upstream behaviour."""

from __future__ import annotations

import dataclasses

import pytest

from detent_audit.manifests.deployment import load_deployment, shipped_deployments
from detent_audit.selection.compiler import solve
from detent_audit.selection.lang import SelectionFailure, knob_settings
from detent_audit.selection.programs import all_reduce, families_for


def dep(name: str):
    return load_deployment(shipped_deployments()[name])


def solved(name: str, family: str, deployment=None):
    d = deployment or dep(name)
    spec = next(s for s in families_for(d) if s.name == family)
    return spec, solve(spec.program, spec.facts(d), family=spec.name)


# ---- all-reduce ----

def test_vllm_tp4_default_never_takes_nccl_by_size() -> None:
    _, r = solved("llama-3.1-70b-instruct-tp4-h100-vllm", "all_reduce")
    sel = r.selector()
    paths = {sel(n, n).path for n in range(1, 8193, 7)} | {sel(8192, 8192).path}
    assert len(paths) == 1 and not next(iter(paths)).startswith("nccl"), paths
    assert all(a["path"] != "nccl/tuner" for a in r.legal_assignments())


def test_nccl_is_legal_only_pinned_with_its_chain_order_recorded() -> None:
    # the same deployment with NCCL_ALGO / NCCL_PROTO / channels pinned: still not legal, as the channel an
    # element falls in (and so its chain) moves with the message size
    d = dep("llama-3.1-70b-instruct-tp4-h100-vllm")
    pinned = dataclasses.replace(d, engine=dataclasses.replace(d.engine, nccl_algo="allreduce:tree",
                                                               nccl_proto="Simple", nccl_channels=4))
    assert all_reduce.facts(pinned).nccl_path == "nccl/allreduce:tree.Simple.4ch"
    _, r = solved("", "all_reduce", pinned)
    assert "nccl/allreduce:tree.Simple.4ch" not in {a["path"] for a in r.legal_assignments()}
    # ... legal once the deployment records every channel's chain order
    chain = dataclasses.replace(pinned.engine, nccl_chain_order="0,1,2,3 on every channel")
    ordered = dataclasses.replace(pinned, engine=chain)
    _, r = solved("", "all_reduce", ordered)
    assert "nccl/allreduce:tree.Simple.4ch" in {a["path"] for a in r.legal_assignments()}
    # algorithm pinned but not the protocol: still NCCL's choice by size
    half = dataclasses.replace(d, engine=dataclasses.replace(d.engine, nccl_algo="allreduce:tree"))
    assert all_reduce.facts(half).nccl_path == ""
    bi = dataclasses.replace(d, engine=dataclasses.replace(d.engine, batch_invariant=True))
    assert all_reduce.facts(bi).nccl_path == "nccl/tree.Simple.1ch"


SGLANG_PATHS = {"custom/1shot_push", "custom/1shot_pull", "custom/2shot_pull_mc", "custom/2shot_pull"}


def test_ordered_all_reduce_is_the_legal_path_of_both_engines() -> None:
    for name in ("llama-3.1-70b-instruct-tp4-h100-vllm", "llama-3.1-70b-instruct-tp4-h100-sglang",
                 "qwen3-30b-a3b-tp4-h100-vllm", "qwen3-30b-a3b-tp4-h100-sglang"):
        spec, r = solved(name, "all_reduce")
        assert all_reduce.ORDERED_PATH in {a["path"] for a in r.legal_assignments()}, name
        with knob_settings({"all_reduce.ordered": True}):
            facts = spec.facts(dep(name))
            args = [(n, n) if spec.key == "all_reduce_vllm" else (n, g, n)
                    for n in (1, 700, 8192) for g in (0, 1)]
            assert {spec.program(facts, *a).path for a in args} == {all_reduce.ORDERED_PATH}, name


def test_sglang_all_reduce_is_one_value_and_only_upstream_pairs() -> None:
    spec, r = solved("llama-3.1-70b-instruct-tp4-h100-sglang", "all_reduce")
    facts = spec.facts(dep("llama-3.1-70b-instruct-tp4-h100-sglang"))
    assert [p.name for p in r.pins] == ["path"]
    legal = {a["path"] for a in r.legal_assignments()}
    # the file pins NCCL's algorithm, protocol and channels but records no chain order: detent's path only
    assert legal == {all_reduce.ORDERED_PATH}
    # the unpinned program produces only upstream pairs too, at every size, in and out of CUDA graphs (with
    # NCCL's chain order recorded, so that its pinned path runs)
    facts = dataclasses.replace(facts, nccl_chain_order="recorded")
    seen = {spec.program(facts, n, g, n).path for n in range(1, 8193, 31) for g in (0, 1)}
    assert seen <= SGLANG_PATHS | {facts.nccl_path}


def test_sglang_without_pinned_nccl_has_only_the_ordered_all_reduce() -> None:
    d = dep("llama-3.1-70b-instruct-tp4-h100-sglang")
    bare = dataclasses.replace(d, engine=dataclasses.replace(d.engine, nccl_algo="", nccl_proto="",
                                                             nccl_channels=0))
    _, r = solved("", "all_reduce", bare)
    # 128 MiB steps exceed every workspace, so the engine's own dispatch ends in NCCL by size
    assert {a["path"] for a in r.legal_assignments()} == {all_reduce.ORDERED_PATH}
    with pytest.raises(SelectionFailure, match="NCCL picks"):
        all_reduce.all_reduce_sglang(all_reduce.facts(bare), 8192, 0, 8192)


# ---- FA3 as SGLang builds and calls it ----

def test_sglang_runs_the_sgl_attn_build() -> None:
    from detent_audit.selection.programs import fa3

    for name in shipped_deployments():
        d = dep(name)
        if d.engine.name == "sglang":
            assert [s.key for s in families_for(d)][0] == "fa3_sglang", name
            assert d.engine.fa3_source == fa3.SGLANG_FA3_SOURCE, name


def test_sglang_hdim64_tiles_are_upstreams_at_f20a5232() -> None:
    from detent_audit.selection.programs import fa3

    d = fa3.facts(dep("llama-3.2-1b-tp1-h100-sglang"))            # head dim 64, 1-token pages (no TMA)
    decode = fa3.fa3_sglang(d, 8, 8, 1, 1000, 64, 1000)
    mixed = fa3.fa3_sglang(d, 600, 8, 593, 1000, 64, 1000)
    # f20a5232 tile_size.h (upstream 9dbed03's): kBlockN 128 for causal, local or paged KV without TMA, so a
    # decode batch, which drops causal, keeps 128 on 1-token pages, as upstream does
    assert (decode.is_causal, decode.block_n) == (False, 128)
    assert (mixed.is_causal, mixed.block_n) == (True, 128)
    assert (decode.block_m, decode.block_n) == (fa3.fa3(d, 8, 8, 1, 1000, 64, 1000).block_m,
                                                fa3.fa3(d, 8, 8, 1, 1000, 64, 1000).block_n)
    # hdim 64 / dv 256: (128, 96), upstream's row
    assert fa3.tile_size_fwd_sm90(64, 256, True, False, 2, True, False) == (128, 96)


def test_sglang_splits_dynamically_above_992_sequences() -> None:
    from detent_audit.selection.programs import fa3

    # f20a5232 flash_api.cpp:958: the prepare kernel runs at every batch size (39da714b stopped at 992),
    # so get_num_splits counts one sequence whatever the batch: the same static count at 8 and 1000 sequences
    d = dataclasses.replace(fa3.facts(dep("llama-3.1-70b-instruct-tp4-h100-sglang")), max_num_seqs=2048)
    few = fa3.fa3_sglang(d, 600, 8, 2, 30000, 64, 30000)
    many = fa3.fa3_sglang(d, 1100, 1000, 2, 30000, 64, 30000)
    assert few.num_splits == many.num_splits > 1


def test_sglang_heuristic_reads_the_page_table_width() -> None:
    from detent_audit.selection.programs import fa3

    d = fa3.facts(dep("llama-3.1-70b-instruct-tp4-h100-sglang"))   # context 32768, decode graphs to 256
    # in a decode CUDA graph the page table is context-wide: the split count ignores the live max_seqlen_k
    graph = {fa3.fa3_sglang(d, 4, 4, 1, k, 64, k).num_splits for k in (100, 2000, 30000)}
    assert graph == {fa3.fa3(d, 4, 4, 1, 32768, 64, 32768).num_splits}
    # eagerly (a prefill) the table is max_seqlen_k wide, as upstream with max_seqlen_k
    for k in (2000, 30000):
        sglang = fa3.fa3_sglang(d, 600, 4, 593, k, 64, k)
        assert sglang.num_splits == fa3.fa3(d, 600, 4, 593, k, 64, k).num_splits
    # so the solver sees one value for the graph path's seqlen_k: its split count is the context's
    spec, r = solved("llama-3.1-70b-instruct-tp4-h100-sglang", "attention")
    assert r.program == "fa3_sglang"


# ---- vLLM cascade attention ----

def cascade_opted_in(name: str):
    # vLLM's default keeps cascade attention off (disable_cascade_attn = True); these deployments opt in
    d = dep(name)
    return dataclasses.replace(d, engine=dataclasses.replace(d.engine, disable_cascade_attn=False))


def test_vllm_cascade_switch_follows_the_batch() -> None:
    from detent_audit.selection.programs import fa3

    d = fa3.facts(cascade_opted_in("llama-3.1-8b-instruct-tp1-h100-vllm"))   # 32 heads, 8 KV heads, 132 SMs
    assert d.cascade_enabled
    # a mixed step of 8 requests sharing 300 tokens: no FlashDecoding, cascade
    assert fa3.fa3_vllm(d, 600, 8, 100, 1000, 64, 1000, 300).cascade is True
    # fewer than 8 requests, or a prefix under 256 tokens: never
    assert fa3.fa3_vllm(d, 600, 7, 100, 1000, 64, 1000, 300).cascade is False
    assert fa3.fa3_vllm(d, 600, 8, 100, 1000, 64, 1000, 255).cascade is False
    # GQA decode: the wave model; 16 requests x 4096 shared tokens: 32 waves either way -> FlashDecoding;
    # 64 requests: cascade 32 vs FlashDecoding 125 -> cascade
    assert fa3.fa3_vllm(d, 16, 16, 1, 5000, 64, 5000, 4096).cascade is False
    assert fa3.fa3_vllm(d, 64, 64, 1, 5000, 64, 5000, 4096).cascade is True


def test_cascade_is_a_pin_legal_only_off_and_absent_when_disabled() -> None:
    _, on = solved("", "attention", cascade_opted_in("llama-3.1-8b-instruct-tp1-h100-vllm"))
    pin = next(p for p in on.pins if p.name == "cascade")
    assert pin.candidates == (False, True) and pin.legal_values == (False,)
    assert "cascade" in on.batch_dependent_points and on.default["cascade"] is False
    sel = on.selector()
    assert {sel(64, 64, 1, 5000, 64, 5000, 4096).cascade,
            sel(600, 8, 100, 1000, 64, 1000, 300).cascade} == {False}
    _, r = solved("llama-3.1-8b-instruct-tp1-h100-vllm", "attention")   # the shipped file: vLLM's default
    assert "cascade" not in r.batch_dependent_points and all(p.name != "cascade" for p in r.pins)


# ---- fused MoE ----

def test_vllm_naive_block_assignment_switch() -> None:
    from detent_audit.selection.programs import fused_moe

    d = fused_moe.facts(dep("qwen3-30b-a3b-tp4-h100-vllm"))      # 128 experts, top 8: 4 x 8 x 4 = 128 <= 128
    assert [fused_moe.fused_moe(d, m).block_assignment for m in (1, 4, 5, 8192)] == ["naive", "naive",
                                                                                      "aligned", "aligned"]
    sgl = fused_moe.facts(dep("qwen3-30b-a3b-tp4-h100-sglang"))   # SGLang has no such switch
    assert {fused_moe.fused_moe(sgl, m).block_assignment for m in (1, 4, 5)} == {"aligned"}
    # the solved default is one assignment for every batch
    _, r = solved("qwen3-30b-a3b-tp4-h100-vllm", "moe")
    assert "block_assignment" in r.batch_dependent_points
    sel = r.selector()
    assert len({sel(m) for m in (1, 4, 5, 100, 8192)}) == 1


def test_sglang_down_projection_table() -> None:
    from detent_audit.manifests.deployment import MoeConfigRow
    from detent_audit.selection.programs import fused_moe

    d = dep("qwen3-30b-a3b-tp4-h100-sglang")
    down = ((1, MoeConfigRow(16, 32, 256, 1, 4, 2)), (64, MoeConfigRow(64, 128, 64, 16, 8, 4)))
    with_down = dataclasses.replace(d, tables=dataclasses.replace(d.tables, fused_moe_down=down))
    facts = fused_moe.facts(with_down)
    small, large = fused_moe.fused_moe(facts, 2), fused_moe.fused_moe(facts, 500)
    assert (small.down_block_size_k, small.down_num_stages) == (256, 2)          # nearest key 1
    assert (large.down_block_size_n, large.down_group_size_m, large.down_num_warps) == (128, 16, 8)  # key 64
    # BLOCK_SIZE_M stays the up projection's; without the down file both GEMMs share the up config
    plain = fused_moe.fused_moe(fused_moe.facts(d), 500)
    assert (plain.down_block_size_k, plain.down_num_warps) == (plain.block_size_k, plain.num_warps)
    # vLLM reads no down file
    v = dep("qwen3-30b-a3b-tp4-h100-vllm")
    v_down = dataclasses.replace(v, tables=dataclasses.replace(v.tables, fused_moe_down=down))
    assert fused_moe.facts(v_down).has_down_table is False


# ---- FlashInfer's planner (B200) ----

def test_flashinfer_cta_tile_q_from_the_packed_query_length() -> None:
    from detent_audit.selection.programs import flashinfer

    d = flashinfer.facts(dep("llama-3.1-8b-instruct-tp1-b200-vllm"))   # 32 heads / 8 KV heads: packed x 4
    tile = lambda t, s, q: flashinfer.flashinfer_prefill(d, t, s, q, 100, 8, 1600).cta_tile_q  # noqa: E731
    # eagerly: the batch's average packed length (num_tokens x 4 // num_seqs): > 64 -> 128, > 16 -> 64, else
    # 16
    assert [tile(2000, 100, 50), tile(1620, 100, 50), tile(500, 100, 50), tile(400, 100, 50)] == [128, 64,
                                                                                                 64, 16]
    # in a decode graph: (num_tokens - num_seqs + 1) x 4 = 4 -> 16, whatever the batch
    assert tile(200, 200, 1) == 16


def test_flashinfer_kv_chunk_by_binary_search_over_the_batch() -> None:
    from detent_audit.selection.programs import flashinfer

    d = flashinfer.facts(dep("llama-3.1-8b-instruct-tp1-b200-vllm"))   # 148 SMs: 2 x 148 // 8 = 37 work items
    pick = flashinfer.flashinfer_prefill
    # one request, 1 query tile, 1000 pages: the smallest chunk c with ceil(1000 / c) <= 37 is 28
    one = pick(d, 600, 1, 600, 1000, 1, 16000)
    assert (one.kv_chunk_size, one.split_kv) == (28, True)
    # ten query tiles on the same KV: ceil(1000 / c) <= 3 -> 334 pages; the chunk follows the batch
    assert pick(d, 600, 1, 600, 1000, 10, 16000).kv_chunk_size == 334
    # short KV: at least 128 tokens (8 pages) per chunk, and no split when one chunk holds it all
    short = pick(d, 600, 1, 600, 8, 40, 128)
    assert (short.kv_chunk_size, short.split_kv) == (8, False)


def test_flashinfer_default_tuple_is_constant() -> None:
    _, r = solved("llama-3.1-8b-instruct-tp1-b200-vllm", "attention")
    assert {p.name for p in r.pins} >= {"kv_chunk_size", "cta_tile_q"}
    sel = r.selector()
    assert len({sel(t, s, q, k, n, 16) for t, s, q, k, n in ((1, 1, 1, 1, 1), (8192, 3, 8000, 8192, 2000),
                                                              (200, 200, 1, 500, 200))}) == 1


def test_not_transcribed_is_exit_3_for_every_caller() -> None:
    from detent_audit.selection.errors import NotTranscribed

    d = dep("llama-3.1-70b-instruct-tp4-h100-sglang")
    fi = dataclasses.replace(d, engine=dataclasses.replace(d.engine, attention_backend="flashinfer"))
    with pytest.raises(NotTranscribed, match="not transcribed") as exc:
        families_for(fi)                                   # SGLang's FlashInfer backend: no program
    assert exc.value.exit_code == 3
