"""FlashAttention-3 (sm90) kernel selection as SelIR: upstream `hopper/` (`fa3`), the vLLM fork (`fa3_vllm`)
and SGLang's sgl-attn build (`fa3_sglang`).

Transcribed from Dao-AILab/flash-attention @ 0251105a and vllm-project/flash-attention @ 617264c1
(`hopper/flash_api.cpp`, `heuristics.h`, `tile_size.h`, `flash_prepare_scheduler.cu`), as the engines call
them: varlen (`cu_seqlens_q` + `seqused_k`), paged KV, no `leftpad_k`, no in-kernel KV append, sm_margin 0.
Every batch-dependent choice is kept: the decode case
that drops `causal`, the paged-KV TMA switch that moves the tile, the fork's one-MMA-warpgroup decode tiles,
the static split count with its CUDA-graph override, PackGQA, and the per-sequence split count the prepare
kernel derives from the whole batch.

SGLang's build (`fa3_sglang`): sgl-kernel's CMakeLists fetches sgl-project/sgl-attn (now sgl-flash-attn),
not Dao-AILab (sgl-project/sglang @ 00390b86 sgl-kernel/CMakeLists.txt:91-98, the "# flash-attention"
FetchContent block, GIT_TAG f20a5232). Transcribed from that commit, `SGLANG_FA3_SOURCE`, which the
deployment must record as `fa3_source` (`facts` refuses any other build): upstream flash-attention 9dbed03
plus attention sinks. Its hopper/tile_size.h and heuristics.h equal upstream's (byte for byte at 9dbed03,
and at 0251105a, which `fa3` transcribes), and its mha_fwd equals upstream's but for the sinks argument; what
SGLang's calls change is seqlen_k (the page table's width) and when a step runs in a CUDA graph.

Knob `attention.split_stride` (detent's): 0 keeps FA3's count-based splitting; a stride S cuts each
sequence's KV at multiples of S tokens, so a pinned tuple can still split long sequences while every split
boundary depends on the request alone.

Runtime inputs, computed by the caller from the batch: `num_tokens` (the step's tokens: decides whether the
step runs in a full CUDA graph), `num_seqs`, `max_seqlen_q`, `max_seqlen_k`, and `total_blocks` = the sum over
the batch of ceil(q_i * (h/h_k if pack_gqa else 1) / block_m) * ceil(k_i / block_n) in this selection's tile
(what `prepare_varlen_num_blocks_kernel` sums on device; the tile depends on max_seqlen_q only, so the
caller computes it first). Request input: `seqlen_k`, the sequence's own KV length.
"""

from __future__ import annotations

from detent_audit.manifests.deployment import Deployment
from detent_audit.selection.errors import NotTranscribed
from detent_audit.selection.lang import (
    Request,
    Runtime,
    assume,
    cdiv,
    ceil,
    clamp,
    knob,
    program,
    record,
    require,
    round_up,
)

SIZE_L2 = 50 * 1024 * 1024             # heuristics.h num_splits_heuristic: assumed L2 size (50 MB)
MAX_SPLITS_HEURISTIC = 128             # flash_api.cpp get_num_splits: max_splits
MAX_SPLITS_COMBINE = 256               # flash_api.cpp mha_fwd: "num_splits > 256 not supported"
PREPARE_VARLEN_MAX_BATCHES_1CTA = 992  # flash_api.cpp: one prepare-kernel CTA covers 992 sequences
# the FlashAttention-3 build SGLang's sgl-kernel compiles, which `fa3_sglang` transcribes
SGLANG_FA3_SOURCE = "sgl-project/sgl-attn@f20a52329482ddca4a627b2f028f88c2959ee299"
MIN_TILE = 64                          # smallest kBlockM / kBlockN of tile_size_fwd_sm90 (input bounds only)


@record
class Fa3Facts:
    num_sms: int
    head_dim: int              # params.d (not rounded)
    head_dim_v: int
    num_heads: int             # h: query heads per TP rank
    num_kv_heads: int          # h_k: KV heads per TP rank
    element_size: int          # 2 (bf16/fp16) or 1 (e4m3)
    softcap: bool
    causal: bool               # what the engine passes (decoder self-attention)
    window_left: int           # sliding window - 1 as the engine passes it; -1: none
    paged_kv: bool
    page_size: int
    varlen: bool
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_query_len: int         # min(max_num_batched_tokens, max_model_len)
    max_total_blocks: int      # bound of total_blocks (analysis only)
    num_splits_arg: int        # num_splits the engine passes outside full CUDA graphs (0: FA3's heuristic)
    graph_num_splits_arg: int  # ... inside full CUDA graphs
    max_cuda_graph_size: int   # 0: no full CUDA graphs
    # vLLM: cascade attention possible (not disabled, not batch-invariant, prefix cache)
    cascade_enabled: bool
    alibi: bool                # ALiBi slopes (cascade does not support them)


@record
class Fa3Choice:
    block_m: int               # kBlockM
    block_n: int               # kBlockN: the KV tile of the online softmax
    is_causal: bool            # the causal kernel variant (dropped for decode-only batches)
    pack_gqa: bool
    num_splits: int            # params.num_splits: the static bound; the Split kernel runs when > 1
    num_splits_dynamic: int    # this sequence's real split count
    kv_blocks_per_split: int   # KV blocks per split of this sequence: where its splits begin
    split_stride: int          # the knob (0: FA3's count-based splitting)
    cascade: bool              # vLLM: the shared prefix in its own non-causal call, merged by LSE


def facts(dep: Deployment) -> Fa3Facts:
    """FA3's view of a deployment (plain Python, not SelIR). Raises `NotTranscribed` for an SGLang deployment
    whose recorded FA3 build is not `SGLANG_FA3_SOURCE`, the one `fa3_sglang` is transcribed from."""
    e, m = dep.engine, dep.model
    if e.name == "sglang" and e.fa3_source != SGLANG_FA3_SOURCE:
        raise NotTranscribed(f"{dep.name}: fa3_source {e.fa3_source!r} is not the FlashAttention-3 build "
                             f"fa3_sglang is transcribed from ({SGLANG_FA3_SOURCE})",
                             remedy="record the commit sgl-kernel/CMakeLists.txt fetches as fa3_source, and "
                             "transcribe fa3_sglang from it when it differs")
    heads, kv_heads = dep.num_heads_per_rank, dep.num_kv_heads_per_rank
    # vLLM flash_attn.py build(): max_num_splits = 1 in batch-invariant mode, else 0 (FA3's heuristic), or
    # flash_attn_max_num_splits_for_cuda_graph for a step that fits a full CUDA graph. SGLang passes 0
    # (1 when deterministic) in and out of graphs: its fact is 0.
    return Fa3Facts(
        num_sms=dep.compute_units, head_dim=m.head_dim, head_dim_v=m.head_dim, num_heads=heads,
        num_kv_heads=kv_heads, element_size=2, softcap=False, causal=True,
        window_left=m.sliding_window - 1 if m.sliding_window > 0 else -1, paged_kv=True,
        page_size=e.page_size, varlen=True, max_model_len=e.max_model_len, max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_query_len=min(e.max_num_batched_tokens, e.max_model_len),
        max_total_blocks=(cdiv(e.max_num_batched_tokens * (heads // kv_heads), MIN_TILE) + e.max_num_seqs)
        * cdiv(e.max_model_len, MIN_TILE),
        num_splits_arg=1 if e.batch_invariant else 0,
        graph_num_splits_arg=1 if e.batch_invariant else e.fa_max_num_splits_for_cuda_graph,
        max_cuda_graph_size=e.max_cuda_graph_size if e.full_cuda_graph else 0,
        # vLLM gpu_model_runner: cascade_attn_enabled = not model_config.disable_cascade_attn, forced off
        # under VLLM_BATCH_INVARIANT; the common prefix comes from the prefix cache's shared blocks. The
        # setting defaults to True (off) since PR #36318 (v0.33.0 vllm/config/model.py:316): only an opt-in
        # sets it
        cascade_enabled=e.name == "vllm" and not e.disable_cascade_attn and not e.batch_invariant
        and e.prefix_caching,
        alibi=False)


@program(family="attention")
def fa3(d: Fa3Facts, num_tokens: Runtime[int], num_seqs: Runtime[int], max_seqlen_q: Runtime[int],
        max_seqlen_k: Runtime[int], total_blocks: Runtime[int], seqlen_k: Request[int]) -> Fa3Choice:
    """Upstream FA3 (Dao-AILab/flash-attention `hopper/`), called with max_seqlen_k."""
    assume_inputs(d, num_tokens, num_seqs, max_seqlen_q, max_seqlen_k, total_blocks, seqlen_k)
    hdim, hdim_v = round_up_headdim(d.head_dim), round_up_headdim(d.head_dim_v)
    is_causal, is_local = attention_flags(d, max_seqlen_q, max_seqlen_k)
    # flash_api.cpp get_pagedkv_tma: TMA for paged KV needs pages of whole KV blocks and enough queries
    # ("when seqlen_q <= kBlockM ... TMA is slower"); the probe tile assumes TMA
    probe_m, probe_n = tile_size_fwd_sm90(hdim, hdim_v, is_causal, is_local, d.element_size, False, d.softcap)
    # (max_seqlen_q * (h / h_k) > probe_m, written as max_seqlen_q > probe_m // (h / h_k): the same for
    # positive integers)
    pagedkv_tma = (d.paged_kv and d.page_size % probe_n == 0
                   and max_seqlen_q > probe_m // (d.num_heads // d.num_kv_heads))
    paged_non_tma = d.paged_kv and not pagedkv_tma
    block_m, block_n = tile_size_fwd_sm90(hdim, hdim_v, is_causal, is_local, d.element_size, paged_non_tma,
                                          d.softcap)
    in_graph = d.max_cuda_graph_size > 0 and num_tokens <= d.max_cuda_graph_size
    num_splits = static_num_splits(d, in_graph, d.varlen, num_seqs, max_seqlen_q, max_seqlen_k, block_m,
                                   block_n, is_causal, is_local)
    stride = knob("attention.split_stride", (0, 256, 512, 1024, 2048, 4096), 0)
    if stride > 0:
        num_splits = cdiv(max_seqlen_k, max(1, stride))  # enough splits for the batch's longest sequence
    # flash_api.cpp get_pack_gqa (always packed for paged non-TMA KV or a Split kernel)
    pack_gqa = paged_non_tma or num_splits > 1 or (
        d.num_heads != d.num_kv_heads
        and should_pack_gqa(d.varlen, max_seqlen_q, d.num_heads // d.num_kv_heads, block_m))
    dynamic, blocks_per_split = per_sequence_splits(d, stride, d.varlen, num_seqs, total_blocks, seqlen_k,
                                                    block_n, pack_gqa, num_splits)
    require(1 <= num_splits <= MAX_SPLITS_COMBINE, "the combine kernel takes 1 to 256 splits")
    require(is_causal or is_local or not d.causal or max_seqlen_q == 1,
            "only a decode-only batch may drop the causal mask")
    require(is_local or d.window_left < 0 or d.window_left >= max_seqlen_k - 1,
            "a sliding window shorter than the context needs the local kernel")
    return Fa3Choice(block_m=block_m, block_n=block_n, is_causal=is_causal, pack_gqa=pack_gqa,
                     num_splits=num_splits, num_splits_dynamic=dynamic, kv_blocks_per_split=blocks_per_split,
                     split_stride=stride, cascade=False)


@program(family="attention")
def fa3_vllm(d: Fa3Facts, num_tokens: Runtime[int], num_seqs: Runtime[int], max_seqlen_q: Runtime[int],
             max_seqlen_k: Runtime[int], total_blocks: Runtime[int], seqlen_k: Request[int],
             common_prefix_len: Runtime[int]) -> Fa3Choice:
    """vLLM's FA3 fork (vllm_flash_attn): the one-MMA-warpgroup decode switch, its own tile table, and the
    FlashAttention backend's cascade switch. `common_prefix_len`: the tokens every request of the step shares
    (the runner's _compute_cascade_attn_prefix_len, before use_cascade_attention)."""
    assume_inputs(d, num_tokens, num_seqs, max_seqlen_q, max_seqlen_k, total_blocks, seqlen_k)
    assume(0 <= common_prefix_len <= d.max_model_len, "a shared prefix fits the context")
    hdim, hdim_v = round_up_headdim(d.head_dim), round_up_headdim(d.head_dim_v)
    is_causal, is_local = attention_flags(d, max_seqlen_q, max_seqlen_k)
    ratio = d.num_heads // d.num_kv_heads
    # fork heuristics.h use_one_mma_wg: decode-sized query blocks (max_seqlen_q for varlen, PackGQA assumed):
    # max_seqlen_q * ratio <= 64, written as max_seqlen_q <= 64 // ratio (the same for positive integers)
    one_mma_wg = (d.head_dim == 128 or d.head_dim == 64) and not is_local and max_seqlen_q <= 64 // ratio
    # fork get_pagedkv_tma: as upstream, also off for local attention; the probe tile sees one_mma_wg
    probe_m, probe_n = tile_size_fwd_sm90_vllm(hdim, hdim_v, is_causal, is_local, d.element_size, False,
                                               d.softcap, one_mma_wg)
    pagedkv_tma = (d.paged_kv and not is_local and d.page_size % probe_n == 0
                   and max_seqlen_q > probe_m // ratio)             # max_seqlen_q * ratio > probe_m
    paged_non_tma = d.paged_kv and not pagedkv_tma
    block_m, block_n = tile_size_fwd_sm90_vllm(hdim, hdim_v, is_causal, is_local, d.element_size,
                                               paged_non_tma, d.softcap, one_mma_wg)
    in_graph = d.max_cuda_graph_size > 0 and num_tokens <= d.max_cuda_graph_size
    num_splits = static_num_splits(d, in_graph, d.varlen, num_seqs, max_seqlen_q, max_seqlen_k, block_m,
                                   block_n, is_causal, is_local)
    stride = knob("attention.split_stride", (0, 256, 512, 1024, 2048, 4096), 0)
    if stride > 0:
        num_splits = cdiv(max_seqlen_k, max(1, stride))
    # fork get_pack_gqa: as upstream, plus PackGQA for hdim 64 local attention with 8 query heads per KV head
    pack_override = ratio == 8 and is_local and d.head_dim == 64 and d.head_dim_v == d.head_dim
    pack_gqa = paged_non_tma or num_splits > 1 or pack_override or (
        d.num_heads != d.num_kv_heads and should_pack_gqa(d.varlen, max_seqlen_q, ratio, block_m))
    # fork mha_fwd: "disable split for varlen and >992 batches" (after PackGQA was chosen; FA3's own
    # splitting only: with a stride the bound is detent's)
    if d.varlen and num_seqs > PREPARE_VARLEN_MAX_BATCHES_1CTA and stride == 0:
        num_splits = 1
    dynamic, blocks_per_split = per_sequence_splits(d, stride, d.varlen, num_seqs, total_blocks, seqlen_k,
                                                    block_n, pack_gqa, num_splits)
    # vLLM v1/attention/backends/flash_attn.py build(): use_cascade = common_prefix_len > 0, where the runner
    # passes the prefix only if use_cascade_attention says so; the prefix then runs as its own call
    # (causal=False, the batch as one query block) and merges with the suffix by LSE: a request's sums split
    # at a boundary the batch chooses. The two calls' own tiles are not modelled: a legal tuple keeps it off.
    cascade = d.cascade_enabled and use_cascade_attention(d, common_prefix_len, num_seqs, max_seqlen_q)
    require(not cascade or common_prefix_len >= 256,
            "cascade attention merges at the step's shared prefix, which only the batch decides")
    require(1 <= num_splits <= MAX_SPLITS_COMBINE, "the combine kernel takes 1 to 256 splits")
    require(is_causal or is_local or not d.causal or max_seqlen_q == 1,
            "only a decode-only batch may drop the causal mask")
    require(is_local or d.window_left < 0 or d.window_left >= max_seqlen_k - 1,
            "a sliding window shorter than the context needs the local kernel")
    return Fa3Choice(block_m=block_m, block_n=block_n, is_causal=is_causal, pack_gqa=pack_gqa,
                     num_splits=num_splits, num_splits_dynamic=dynamic, kv_blocks_per_split=blocks_per_split,
                     split_stride=stride, cascade=cascade)


@program(family="attention")
def fa3_sglang(d: Fa3Facts, num_tokens: Runtime[int], num_seqs: Runtime[int], max_seqlen_q: Runtime[int],
               max_seqlen_k: Runtime[int], total_blocks: Runtime[int], seqlen_k: Request[int]) -> Fa3Choice:
    """The FA3 SGLang runs: sgl-kernel's build of sgl-project/sgl-attn @ f20a5232 (`SGLANG_FA3_SOURCE`),
    called through `flash_attn_with_kvcache` with a page table, cu_seqlens_q and cache_seqlens (varlen), and
    no cu_seqlens_k. Citations are file:line of sgl-project/sgl-flash-attn @ f20a5232."""
    assume_inputs(d, num_tokens, num_seqs, max_seqlen_q, max_seqlen_k, total_blocks, seqlen_k)
    hdim, hdim_v = round_up_headdim(d.head_dim), round_up_headdim(d.head_dim_v)
    # SGLang's decode CUDA graphs (flashattention_backend.py init_cuda_graph_state) hold decode-only batches
    # up to cuda_graph_max_bs; prefill and extend run eagerly
    in_graph = d.max_cuda_graph_size > 0 and max_seqlen_q == 1 and num_tokens <= d.max_cuda_graph_size
    # hopper/flash_api.cpp:749 (mha_fwd): paged KV without cu_seqlens_k (which paged KV refuses, :735) takes
    # seqlen_k = the page table's width x page_size; max_seqlen_k is read only with cu_seqlens_k. SGLang's
    # graphs' page table is ceil(context_len / page_size) wide (flashattention_backend.py
    # init_cuda_graph_state, decode_cuda_graph_metadata["page_table"]); eagerly it is
    # req_to_token[:, :max_seq_len_k]
    kernel_seqlen_k = (round_up(d.max_model_len, d.page_size) if in_graph
                       else round_up(max_seqlen_k, d.page_size))
    is_causal, is_local = attention_flags(d, max_seqlen_q, kernel_seqlen_k)
    # flash_api.cpp:395-404 get_pagedkv_tma: the probe tile assumes TMA; tile_size.h tile_size_fwd_sm90 is
    # upstream's (tile_size.h equals Dao-AILab 9dbed03's and 0251105a's)
    probe_m, probe_n = tile_size_fwd_sm90(hdim, hdim_v, is_causal, is_local, d.element_size, False, d.softcap)
    pagedkv_tma = (d.paged_kv and d.page_size % probe_n == 0
                   and max_seqlen_q > probe_m // (d.num_heads // d.num_kv_heads))
    paged_non_tma = d.paged_kv and not pagedkv_tma
    block_m, block_n = tile_size_fwd_sm90(hdim, hdim_v, is_causal, is_local, d.element_size, paged_non_tma,
                                          d.softcap)
    # flash_api.cpp:958-964: use_prepare_varlen = is_varlen at every batch size (the 992 bound now only
    # gates the one-CTA launch, :959), so get_num_splits (:422-455) counts one sequence (:448)
    num_splits = static_num_splits(d, in_graph, d.varlen, num_seqs, max_seqlen_q, kernel_seqlen_k, block_m,
                                   block_n, is_causal, is_local)
    stride = knob("attention.split_stride", (0, 256, 512, 1024, 2048, 4096), 0)
    if stride > 0:
        num_splits = cdiv(max_seqlen_k, max(1, stride))
    # flash_api.cpp:406-420 get_pack_gqa (as upstream)
    pack_gqa = paged_non_tma or num_splits > 1 or (
        d.num_heads != d.num_kv_heads
        and should_pack_gqa(d.varlen, max_seqlen_q, d.num_heads // d.num_kv_heads, block_m))
    # hopper/flash_prepare_scheduler.cu:124-143 (upstream 9dbed03's): above 992 sequences the prepare kernel
    # runs on several CTAs and gives every sequence one split (per_sequence_splits)
    dynamic_splits, blocks_per_split = per_sequence_splits(d, stride, d.varlen, num_seqs, total_blocks,
                                                           seqlen_k, block_n, pack_gqa, num_splits)
    require(1 <= num_splits <= MAX_SPLITS_COMBINE, "the combine kernel takes 1 to 256 splits")
    require(is_causal or is_local or not d.causal or max_seqlen_q == 1,
            "only a decode-only batch may drop the causal mask")
    require(is_local or d.window_left < 0 or d.window_left >= kernel_seqlen_k - 1,
            "a sliding window shorter than the context needs the local kernel")
    return Fa3Choice(block_m=block_m, block_n=block_n, is_causal=is_causal, pack_gqa=pack_gqa,
                     num_splits=num_splits, num_splits_dynamic=dynamic_splits,
                     kv_blocks_per_split=blocks_per_split, split_stride=stride, cascade=False)


# ---- helpers (inlined by the compiler) ----

def assume_inputs(d, num_tokens, num_seqs, max_seqlen_q, max_seqlen_k, total_blocks, seqlen_k):
    # the engine's limits bound every runtime input (and the analysis' domains)
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    assume(1 <= num_seqs <= d.max_num_seqs, "a batch holds at most max_num_seqs sequences")
    assume(1 <= max_seqlen_q <= d.max_query_len, "a query chunk fits the token budget and the context")
    assume(1 <= max_seqlen_k <= d.max_model_len, "a sequence fits the model's context")
    assume(1 <= total_blocks <= d.max_total_blocks, "the batch's attention blocks, bounded by its limits")
    assume(1 <= seqlen_k <= d.max_model_len, "the sequence fits the model's context")
    return 0


def use_cascade_attention(d, common_prefix_len, num_reqs, max_seqlen_q):
    # vLLM v1/attention/backends/flash_attn.py use_cascade_attention: "too short common prefix" (< 256),
    # no ALiBi / sliding / local attention, "too few queries" (< 8 requests), no DCP; then cascade unless
    # FlashDecoding is used (GQA decode: all query lens 1), where a wave model of 128 x 128 tiles decides
    ratio = d.num_heads // d.num_kv_heads
    cascade = (common_prefix_len >= 256 and not d.alibi and d.window_left < 0 and num_reqs >= 8)
    flash_decoding = ratio > 1 and not d.alibi and d.window_left < 0 and max_seqlen_q == 1
    prefix_tiles = cdiv(common_prefix_len, 128)
    cascade_time = cdiv(d.num_heads * cdiv(num_reqs, 128), d.num_sms) * prefix_tiles
    flash_decoding_time = cdiv(num_reqs * d.num_kv_heads * cdiv(ratio, 128) * prefix_tiles, d.num_sms)
    return cascade and (not flash_decoding or cascade_time < flash_decoding_time)


def round_up_headdim(head_size):
    # flash_api.cpp round_up_headdim: the head dims the kernels are compiled for
    if head_size <= 64:
        return 64
    if head_size <= 96:
        return 96
    if head_size <= 128:
        return 128
    if head_size <= 192:
        return 192
    return 256


def attention_flags(d, max_seqlen_q, max_seqlen_k):
    # flash_api.cpp mha_fwd: a window covering all of max_seqlen_k is no window; "causal=true is the same as
    # causal=false" when every query is its sequence's last position (max_seqlen_q == 1), except hdim in
    # (64, 128] with paged KV (kept causal for its kBlockN 128); is_causal = no left window and right == 0
    window_left = d.window_left
    if window_left >= max_seqlen_k - 1:
        window_left = -1
    causal = d.causal
    if max_seqlen_q == 1 and window_left == -1 and (d.head_dim <= 64 or d.head_dim > 128 or not d.paged_kv):
        causal = False
    is_causal = causal and window_left < 0
    is_local = window_left >= 0 and not is_causal
    return is_causal, is_local


def tile_size_fwd_sm90(hdim, hdim_v, is_causal, is_local, element_size, paged_non_tma, softcap):
    # upstream tile_size.h tile_size_fwd_sm90 -> (kBlockM, kBlockN); v_colmajor is false for these callers
    if element_size == 2:
        if hdim <= 64:
            if hdim_v == 512:
                tile = (64, 64)
            elif hdim_v == 256:
                tile = (128, 96)
            else:
                tile = (192, 128 if is_causal or is_local or paged_non_tma else 192)
        elif hdim <= 96:
            tile = (192, 128 if is_local or paged_non_tma else 144)
        elif hdim <= 128:
            tile = (128, 128 if is_causal or is_local or paged_non_tma else 176)
        elif hdim <= 192:
            tile = (128, 96 if paged_non_tma or is_local else (128 if hdim_v <= 128 else 112))
        else:
            tile = (128, 64 if is_local else 80)
    else:
        if hdim <= 64:
            tile = (192, 160)
        elif hdim <= 96:
            tile = (192, 128)
        elif hdim <= 128:
            tile = (128, 160 if paged_non_tma else (192 if softcap and is_local else 224))
        elif hdim <= 192:
            tile = (128, 128 if (paged_non_tma or softcap) and is_local else 160)
        else:
            tile = (128, 64 if is_local else 128)
    return tile


def tile_size_fwd_sm90_vllm(hdim, hdim_v, is_causal, is_local, element_size, paged_non_tma, softcap,
                            one_mma_wg):
    # vLLM fork tile_size.h: 16-bit decode tiles with one MMA warpgroup, its own hdim 64/128/192 rows, FP8
    # decode tiles and the two-level-accumulation FP8 prefill tiles (the default build)
    if element_size == 2:
        if hdim <= 64:
            if hdim_v == 512:
                tile = (64, 64)
            elif hdim_v == 256:
                tile = (128, 96)
            elif one_mma_wg:
                tile = (64, 192)
            else:
                tile = (192, 128 if is_causal else (160 if is_local or paged_non_tma else 192))
        elif hdim <= 96:
            tile = (192, 128 if is_local or paged_non_tma else 144)
        elif hdim <= 128:
            tile = (64 if one_mma_wg else 128,
                    128 if is_causal or is_local or paged_non_tma else (176 if one_mma_wg else 160))
        elif hdim <= 192:
            tile = (128, 96 if paged_non_tma or is_local else (128 if hdim_v <= 128 else 96))
        else:
            tile = (128, 64 if is_local else 80)
    elif one_mma_wg:
        tile = (64, 128 if hdim <= 96 else 96)
    else:
        if hdim <= 64:
            tile = (192, 128)
        elif hdim <= 96:
            tile = (128, 128)
        elif hdim <= 128:
            tile = (128, 192)
        elif hdim <= 192:
            tile = (128, 96)
        else:
            tile = (128, 64 if is_local else 128)
    return tile


def static_num_splits(d, in_graph, dynamic, num_seqs, max_seqlen_q, max_seqlen_k, block_m, block_n, is_causal,
                      is_local):
    # the engine's num_splits argument (vLLM flash_attn.py build(): a step that fits a full CUDA graph gets
    # the graph bound), then flash_api.cpp mha_fwd: num_splits <= 0 -> get_num_splits(params). max_seqlen_k
    # is params.seqlen_k as the kernel sees it; `dynamic`: the prepare kernel splits per sequence
    arg = d.graph_num_splits_arg if in_graph else d.num_splits_arg
    # get_num_splits: PackGQA assumed; varlen pretends batch = 1 (the dynamic split refines it per sequence)
    seqlen_q_packgqa = max_seqlen_q * (d.num_heads // d.num_kv_heads)
    seqlen_k_loaded = max(0, min(max_seqlen_k, d.window_left + 1 + block_m)) if is_local else max_seqlen_k
    num_n_blocks = cdiv(seqlen_k_loaded, block_n)
    num_m_blocks = cdiv(seqlen_q_packgqa, block_m)
    size_one_kv_head = max_seqlen_k * (d.head_dim + d.head_dim_v) * d.element_size
    total_mblocks = (1 if dynamic else num_seqs) * d.num_kv_heads * num_m_blocks
    heuristic = num_splits_heuristic(total_mblocks, d.num_sms, num_n_blocks, num_m_blocks, size_one_kv_head,
                                     is_causal or is_local, MAX_SPLITS_HEURISTIC)
    return heuristic if arg <= 0 else arg


def num_splits_heuristic(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head,
                         is_causal_or_local, max_splits):
    # heuristics.h num_splits_heuristic. Upstream keeps n_waves and efficiencies in float32; float64 here
    # (they differ only if an efficiency lies within float32 rounding of 0.85 x the best).
    # the loop 1..min(max_splits, num_sms, num_n_blocks), unrolled over the static 1..min(max_splits, num_sms)
    cap = min(max_splits, num_sms, num_n_blocks)
    effs = [split_efficiency(total_mblocks, s, num_sms) if s <= cap else 0.0
            for s in range(1, min(MAX_SPLITS_HEURISTIC, num_sms) + 1)]
    best = max(effs)
    # the smallest count within 85% of the best efficiency (the best qualifies, so one always does)
    first_good = min([s if s <= cap and split_efficiency(total_mblocks, s, num_sms) >= 0.85 * best
                      else MAX_SPLITS_HEURISTIC + 1
                      for s in range(1, min(MAX_SPLITS_HEURISTIC, num_sms) + 1)])
    if total_mblocks >= 0.8 * num_sms:
        # "almost fills the GPU": 1 split, unless one KV head overflows L2, queries go over it at least
        # twice and attention is neither causal nor local
        if size_one_kv_head > SIZE_L2 and num_m_blocks >= 2 * num_sms and not is_causal_or_local:
            splits = min(cdiv(size_one_kv_head, SIZE_L2), max_splits)
        else:
            splits = 1
    elif num_n_blocks <= 4:
        splits = 1     # "we never split for hdim = 128 and seqlen_k = 512"
    else:
        splits = first_good
    return splits


def split_efficiency(total_mblocks, num_splits, num_sms):
    # n_waves / ceil(n_waves): how full the last wave of CTAs is
    n_waves = total_mblocks * num_splits / num_sms
    return n_waves / max(1, ceil(n_waves))


def should_pack_gqa(varlen_q, seqlen_q, qhead_per_khead, block_m):
    # heuristics.h should_pack_gqa: with varlen only max_seqlen_q is known, so always pack; otherwise pack
    # when it fills M tiles clearly better
    nopack = seqlen_q / round_up(seqlen_q, block_m)
    pack = seqlen_q * qhead_per_khead / round_up(seqlen_q * qhead_per_khead, block_m)
    return varlen_q or nopack < 0.9 * pack


def per_sequence_splits(d, stride, dynamic, num_seqs, total_blocks, seqlen_k, block_n, pack_gqa, num_splits):
    # -> (this sequence's split count, KV blocks per split)
    n_blocks = cdiv(seqlen_k, block_n)
    if stride > 0:
        require(stride % block_n == 0, "split_stride is a whole number of KV blocks")
        per_split = max(1, stride // block_n)
        splits = cdiv(n_blocks, per_split)
        require(splits <= num_splits, "the split accumulator holds every split of the sequence")
    else:
        # flash_prepare_scheduler.cu prepare_varlen_num_blocks_kernel: one CTA (<= 992 sequences) sums the
        # blocks of the WHOLE batch; blocks_per_sm = ceil(total * 1.1 * heads / SMs) ("10% margin"); a
        # sequence gets clamp(ceil(n_blocks / blocks_per_sm), 1, num_splits) splits of
        # ceil(n_blocks / splits) blocks. Upstream evaluates the product in float32; exactly here (x 11/10),
        # which equals float32 at 132 SMs for every total up to 2^20 and up to 64 heads (checked with numpy;
        # float64 does not: 360 blocks, 1 head gives 4, not 3). At other SM counts very large totals may
        # differ by one.
        num_head = d.num_kv_heads if pack_gqa else d.num_heads
        blocks_per_sm = max(1, cdiv(total_blocks * 11 * num_head, 10 * d.num_sms))
        splits = clamp(cdiv(n_blocks, blocks_per_sm), 1, num_splits)
        if not dynamic:
            splits = num_splits       # no prepare kernel: every sequence takes the static count
        elif num_seqs > PREPARE_VARLEN_MAX_BATCHES_1CTA or num_splits == 1:
            splits = 1                # more than one CTA, or no Split kernel: no dynamic split
        per_split = cdiv(n_blocks, max(1, splits))
    return splits, per_split
