"""FlashInfer's batch-attention planner as SelIR (`flashinfer_prefill`): what vLLM's FlashInfer backend runs.

Transcribed from flashinfer-ai/flashinfer @ fb28d724: `include/flashinfer/attention/scheduler.cuh`
(`PrefillPlan` :784-797, `PrefillSplitQOKVIndptr` :545-665, `PrefillBinarySearchKVChunkSize` :101-129) and
`include/flashinfer/utils.cuh` (`FA2DetermineCtaTileQ` :408-460). The plan fixes, per step, the query tile
(`cta_tile_q`, from the packed query length) and the KV chunk each CTA reduces (`kv_chunk_size`, by binary
search over the whole batch's work): both set where a request's softmax sums split, so both are
batch-dependent. FlashInfer takes a `fixed_split_size` (and `disable_split_kv`), so a pinned chunk is
realisable. vLLM's TRT-LLM-gen attention path on SM100 (`use_trtllm_attention`) is a different kernel family,
not transcribed: the deployment runs FlashInfer's own kernels (VLLM_USE_TRTLLM_ATTENTION=0).

Runtime inputs: `num_tokens`, `num_seqs`, `max_seqlen_q`, `max_kv_pages` (the longest KV in pages) and
`num_q_tiles` (the batch's total query tiles, sum of ceil(packed_qo_len_i / cta_tile_q); the caller computes
it with this selection's tile). The binary search sums ceil(packed_i / tile) * ceil(kv_i / mid) over the
batch; here every request is taken at `max_kv_pages`: exact for a batch of equal KV lengths, an upper bound
(a chunk at least as long) otherwise. Request input: `seqlen_k`, the sequence's own KV length in tokens.
"""

from __future__ import annotations

from detent_audit.manifests.deployment import Deployment
from detent_audit.selection.lang import Request, Runtime, assume, cdiv, program, record

BLOCKS_PER_SM = 2          # scheduler.cuh PrefillPlan: num_blocks_per_sm = 2
SEARCH_STEPS = 18          # binary search over 1 .. 2^17 pages: enough for every shipped context


@record
class FlashInferFacts:
    num_sms: int
    head_dim: int              # head_dim_vo (= qk for these models)
    num_heads: int             # query heads per TP rank
    num_kv_heads: int
    page_size: int
    window_left: int           # -1: none
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_cuda_graph_size: int   # 0: no full CUDA graphs (decode-only batches up to this size)


@record
class FlashInferChoice:
    cta_tile_q: int            # rows of packed queries per CTA
    kv_chunk_size: int         # KV pages per CTA: where each request's KV reduction splits
    split_kv: bool             # partial outputs merged by LSE (the merge kernel runs)


def facts(dep: Deployment) -> FlashInferFacts:
    """FlashInfer's view of a deployment (plain Python, not SelIR)."""
    e, m = dep.engine, dep.model
    return FlashInferFacts(
        num_sms=dep.compute_units, head_dim=m.head_dim, num_heads=dep.num_heads_per_rank,
        num_kv_heads=dep.num_kv_heads_per_rank, page_size=e.page_size,
        window_left=m.sliding_window - 1 if m.sliding_window > 0 else -1, max_model_len=e.max_model_len,
        max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
        max_cuda_graph_size=e.max_cuda_graph_size if e.full_cuda_graph else 0)


@program(family="attention")
def flashinfer_prefill(d: FlashInferFacts, num_tokens: Runtime[int], num_seqs: Runtime[int],
                       max_seqlen_q: Runtime[int], max_kv_pages: Runtime[int], num_q_tiles: Runtime[int],
                       seqlen_k: Request[int]) -> FlashInferChoice:
    max_pages = cdiv(d.max_model_len, d.page_size)
    gqa = d.num_heads // d.num_kv_heads
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    assume(1 <= num_seqs <= d.max_num_seqs, "a batch holds at most max_num_seqs sequences")
    assume(1 <= max_seqlen_q <= d.max_num_batched_tokens, "a query chunk fits the token budget")
    assume(1 <= max_kv_pages <= max_pages, "a sequence fits the model's context")
    assume(1 <= num_q_tiles <= cdiv(d.max_num_batched_tokens * gqa, 16) + d.max_num_seqs,
           "the batch's query tiles, bounded by its limits")
    assume(1 <= seqlen_k <= d.max_model_len, "the sequence fits the model's context")
    # vLLM captures full CUDA graphs of decode-only batches; their plan runs with enable_cuda_graph
    in_graph = d.max_cuda_graph_size > 0 and max_seqlen_q == 1 and num_tokens <= d.max_cuda_graph_size
    # scheduler.cuh:603-605 (graphs: the longest packed length the graph allows) and :614-619 (the batch's
    # average packed length, an integer division)
    packed = (num_tokens - num_seqs + 1) * gqa if in_graph else (num_tokens * gqa) // max(1, num_seqs)
    cta_tile_q = determine_cta_tile_q(packed, d.head_dim)
    # scheduler.cuh:579: at least 128 tokens of KV per chunk; PrefillPlan :788-791: the grid is
    # num_blocks_per_sm x SMs CTAs, num_kv_heads of them per work item
    min_chunk = max(128 // d.page_size, 1)
    max_batch_if_split = (BLOCKS_PER_SM * d.num_sms) // d.num_kv_heads
    # scheduler.cuh:632: a sliding window bounds the KV a request reads
    kv = min(cdiv(d.window_left + cta_tile_q, d.page_size),
             max_kv_pages) if d.window_left >= 0 else max_kv_pages
    # scheduler.cuh:101-129 PrefillBinarySearchKVChunkSize: the smallest chunk whose work fits the grid
    kv_chunk_size = min_chunk  # `low`
    high = max(kv, 1)
    for _ in range(SEARCH_STEPS):
        mid = (kv_chunk_size + high) // 2
        fits = num_q_tiles * cdiv(max(kv, 1), max(1, mid)) <= max_batch_if_split
        searching = kv_chunk_size < high
        kv_chunk_size = kv_chunk_size if not searching or fits else mid + 1
        high = mid if searching and fits else high
    split_kv = in_graph or kv_chunk_size < max(kv, 1)
    return FlashInferChoice(cta_tile_q=cta_tile_q, kv_chunk_size=kv_chunk_size, split_kv=split_kv)


def determine_cta_tile_q(packed_qo_len, head_dim):
    # utils.cuh:408-460 FA2DetermineCtaTileQ (head dims below 512, 2-byte KV, sm80+): 128 rows above 64
    # packed queries (head_dim < 256), 64 above 16, else 16 (one Q tile and a KV step fit shared memory)
    if packed_qo_len > 64 and head_dim < 256:
        cta_tile_q = 128
    elif packed_qo_len > 16:
        cta_tile_q = 64
    else:
        cta_tile_q = 16
    return cta_tile_q
