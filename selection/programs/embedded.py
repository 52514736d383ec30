"""The embedded detent engine's own kernel selection as SelIR: GEMM, attention and MoE.

These describe what the embedded engine chooses for its own kernels (`kernels/`), written the way a stock
engine would choose them, so the solver finds what to pin:

- GEMM: a form and a row count per matmul call. Stock: one call over the whole batch (chunk = M), so a row's
  bits may depend on M; a pinned chunk makes every call the same shape (the last chunk padded). Two forms
  are legal only where the deployment's facts say a probe proved them on the running CPU (`gemm_pad_rows`,
  `gemm_row_form`): "pad" (one product over the batch, padded to at least the pinned rows) and "row" (each
  row its own product). "fixed" (the project's own product, its order written out) is legal anywhere.
- Attention: a KV tile and a split of each sequence's KV. Stock: split the KV into as many pieces as keep
  the cores busy given the batch (a count, as FA3's heuristic does), so split boundaries move with the batch;
  the `split_stride` knob cuts at fixed multiples instead.
- MoE: a row chunk per expert GEMM, as for GEMM, over the rows routed to one expert.

Knob value 0 of a chunk or stride knob means the stock behaviour.
"""

from __future__ import annotations

from detent_audit.manifests.deployment import DTYPE_BYTES, Deployment
from detent_audit.selection.lang import Request, Runtime, assume, cdiv, clamp, knob, program, record, require

MAX_SPLITS = 16          # most KV splits per sequence the embedded attention kernel combines (CPU)
# on a GPU (kernels/triton_attention.py): the bound that keeps a decode launch's fp32 partials small (a
# sequence's splits x rows x heads x head dim), not a limit of the kernel
GPU_MAX_SPLITS = 64
# A collective backend picks its algorithm per message: NCCL's tuner between tree and ring by size
# (src/enqueue.cc, topoGetAlgoInfo), gloo between its ring and halving-doubling forms. Any such switch makes
# the order of a token's additions a function of the step's size; 256 KiB stands for it here.
BACKEND_SWITCH_BYTES = 256 << 10


@record
class EmbeddedFacts:
    num_cores: int       # parallel units of the device (cores on a CPU)
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_kv_heads: int    # per device
    max_splits: int
    gemm_pad_rows: int   # the pad form's proven least rows (0: not proven)
    gemm_row_form: bool  # the row form proven


@record
class EmbeddedGemmChoice:
    form: str            # chunk | pad | row
    chunk_rows: int      # rows per matmul call (pad: at least; row: 1)


@record
class EmbeddedAttentionChoice:
    kv_tile: int         # KV positions per online-softmax step
    split_stride: int    # the knob (0: count-based splits)
    num_splits: int      # this sequence's KV splits
    tiles_per_split: int  # KV tiles per split: where this sequence's splits begin


@record
class EmbeddedMoeChoice:
    chunk_rows: int      # rows per expert matmul call


@record
class EmbeddedAllReduceFacts:
    tensor_parallel_size: int
    hidden_size: int         # elements of one token's partial sum
    dtype_bytes: int
    max_num_batched_tokens: int
    backend_switch_bytes: int  # the message size where the backend changes algorithm (and so the order)


@record
class EmbeddedAllReduceChoice:
    algorithm: str           # ordered-gather-sum | backend
    order: str               # the order in which a token's partials are added: rank | tree | ring


def all_reduce_facts(dep: Deployment) -> EmbeddedAllReduceFacts:
    """The tensor-parallel all-reduce's view of a deployment (plain Python, not SelIR)."""
    return EmbeddedAllReduceFacts(tensor_parallel_size=dep.parallel.tensor_parallel_size,
                                  hidden_size=dep.model.hidden_size, dtype_bytes=DTYPE_BYTES[dep.model.dtype],
                                  max_num_batched_tokens=dep.engine.max_num_batched_tokens,
                                  backend_switch_bytes=BACKEND_SWITCH_BYTES)


def max_splits(dep: Deployment) -> int:
    """The most KV splits per sequence: the GPU kernel's bound where the deployment runs it (a GPU, or the
    streaming fold, which only the GPU kernel has), else the CPU kernel's."""
    gpu_kernel = dep.gpu is not None or dep.engine.attention_backend == "detent-streaming"
    return GPU_MAX_SPLITS if gpu_kernel else MAX_SPLITS


def facts(dep: Deployment) -> EmbeddedFacts:
    """The embedded engine's view of a deployment (plain Python, not SelIR)."""
    e = dep.engine
    return EmbeddedFacts(num_cores=dep.compute_units, max_num_batched_tokens=e.max_num_batched_tokens,
                         max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len,
                         num_kv_heads=dep.num_kv_heads_per_rank, max_splits=max_splits(dep),
                         gemm_pad_rows=e.gemm_pad_rows, gemm_row_form=e.gemm_row_form)


@program(family="embedded.gemm")
def embedded_gemm(d: EmbeddedFacts, num_tokens: Runtime[int]) -> EmbeddedGemmChoice:
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    form = knob("embedded.gemm.form", ("chunk", "pad", "row", "fixed"), "chunk")
    chunk = knob("embedded.gemm.chunk_rows", (0, 1, 2, 4, 8, 12, 16, 32, 64), 0)
    if form == "pad":
        require(d.gemm_pad_rows > 0, "the pad form only where a probe proved it on this CPU")
        require(chunk >= d.gemm_pad_rows, "pad to at least the rows the probe proved")
        chunk_rows = chunk
    elif form == "row":
        require(d.gemm_row_form, "the row form only where a probe proved it on this CPU")
        require(chunk == 1, "the row form: one row per product")
        chunk_rows = 1
    elif form == "fixed":  # the project's own product: its order written out, invariant on any CPU
        require(chunk == 1, "the fixed form orders each row's products itself")
        chunk_rows = 1
    else:
        require(chunk != 12, "a chunk of 12 rows is a pad size only")
        chunk_rows = num_tokens if chunk == 0 else chunk     # stock: the whole batch in one call
    # what the kernel runs with (a pin fixes chunk_rows itself): the pad form's rows as proven, the row
    # form's 1
    require(form != "pad" or chunk_rows >= d.gemm_pad_rows, "the pad form pads to at least the proven rows")
    require(form != "row" or chunk_rows == 1, "the row form: one row per product")
    require(form != "fixed" or chunk_rows == 1, "the fixed form orders each row's products itself")
    return EmbeddedGemmChoice(form=form, chunk_rows=chunk_rows)


@program(family="embedded.attention")
def embedded_attention(d: EmbeddedFacts, num_seqs: Runtime[int], max_seqlen_k: Runtime[int],
                       seqlen_k: Request[int]) -> EmbeddedAttentionChoice:
    assume(1 <= num_seqs <= d.max_num_seqs, "a batch holds at most max_num_seqs sequences")
    assume(1 <= max_seqlen_k <= d.max_model_len, "a sequence fits the model's context")
    assume(1 <= seqlen_k <= d.max_model_len, "the sequence fits the model's context")
    kv_tile = knob("embedded.attention.kv_tile", (16, 32, 64, 128, 256), 64)
    stride = knob("embedded.attention.split_stride", (0, 64, 128, 256, 512, 1024, 2048, 4096), 0)
    n_tiles = cdiv(seqlen_k, kv_tile)
    if stride > 0:
        require(stride % kv_tile == 0, "split_stride is a whole number of KV tiles")
        tiles_per_split = max(1, stride // kv_tile)
    else:
        # stock: enough splits that sequences x KV heads x splits covers the cores, at most one split per
        # tile of the longest sequence; each sequence cut into that many equal pieces
        count = clamp(cdiv(d.num_cores, num_seqs * d.num_kv_heads), 1,
                      min(d.max_splits, cdiv(max_seqlen_k, kv_tile)))
        tiles_per_split = cdiv(n_tiles, count)
    num_splits = cdiv(n_tiles, tiles_per_split)
    require(num_splits <= d.max_splits, "the combine step takes at most max_splits splits")
    return EmbeddedAttentionChoice(kv_tile=kv_tile, split_stride=stride, num_splits=num_splits,
                                   tiles_per_split=tiles_per_split)


@program(family="embedded.moe")
def embedded_moe(d: EmbeddedFacts, expert_rows: Runtime[int]) -> EmbeddedMoeChoice:
    assume(1 <= expert_rows <= d.max_num_batched_tokens, "an expert gets at most one row per token")
    chunk = knob("embedded.moe.chunk_rows", (0, 1, 2, 4, 8, 16, 32, 64), 0)
    chunk_rows = expert_rows if chunk == 0 else chunk    # stock: all the expert's rows in one call
    return EmbeddedMoeChoice(chunk_rows=chunk_rows)


@program(family="embedded.all_reduce")
def embedded_all_reduce(d: EmbeddedAllReduceFacts, num_tokens: Runtime[int]) -> EmbeddedAllReduceChoice:
    """How the ranks' partial sums of a step meet. Stock: the backend's own all-reduce, whose algorithm (and
    so the order a token's partials are added in) follows the message size, the step's tokens; the ordered
    gather-and-sum adds them in rank order whatever the step (tensor_parallel.py)."""
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    algorithm = knob("embedded.all_reduce.algorithm", ("backend", "ordered-gather-sum"), "backend")
    if algorithm == "backend":
        # the order is also the backend's own beyond size (ring positions, channels): no process with fewer
        # devices can repeat it, so it is never a detent choice, whether or not the size moves it
        require(d.tensor_parallel_size == 1, "the backend's sum order cannot be repeated by rank emulation")
        message = num_tokens * d.hidden_size * d.dtype_bytes
        order = "ring" if message >= d.backend_switch_bytes else "tree"
    else:
        order = "rank"
    return EmbeddedAllReduceChoice(algorithm=algorithm, order=order)
