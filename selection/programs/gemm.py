"""Dense GEMM (linear layer) selection as SelIR: cuBLAS or vLLM 0.33's batch-invariant Triton matmul.

vLLM 0.33 `vllm/model_executor/determinism/batch_invariant.py` and `batch_invariant_configs.py`
(`_get_matmul_config`): for bf16 and an (N, K) shape in the arch's tuned table, BLOCK_M / BLOCK_N / warps /
stages come from M buckets (the first bucket with max_m >= M, else the last) while BLOCK_K is fixed per
shape; an untuned shape uses the default config (bf16 {128, 128, 64, warps 8, stages 3}). The Triton matmul
serves the model's linears in batch-invariant mode when its shapes are tuned (breakable CUDA graphs) or on
the SM80 family, and SGLang's deterministic mode routes aten::mm through the same persistent kernel with its
fixed config. Otherwise the linear is torch.mm on cuBLAS, which picks its kernel (split-K included) from
the M it is called with, inside the library (why batch_invariant.py above sets a cuBLAS workspace that rules
split-K out; Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).

Selection points: the backend; `cublas_m`, the rows cuBLAS is called with (0 on Triton); the M bucket; and
the Triton tile (BLOCK_M, BLOCK_N, BLOCK_K) of each projection (warps and stages follow the bucket).
Knobs: `gemm.backend` (stock: the engine's own rule) and `gemm.pad_rows` (rows padded to a multiple before
the call, so a pinned tile or cuBLAS call sees a fixed M). Runtime input `num_tokens` is the M the selection
reads; `num_tokens_actual` (Unpinnable) is the rows the kernel must compute, read only by the require that
cuBLAS gets all of them.
"""

from __future__ import annotations

from detent_audit.manifests.deployment import BadDeployment, Deployment
from detent_audit.selection.lang import Runtime, Unpinnable, assume, knob, program, record, require, round_up

# batch_invariant.py matmul_persistent default configs: dtype -> (BLOCK_M, BLOCK_N, BLOCK_K)
DEFAULT_TILES = {"bfloat16": (128, 128, 64), "float16": (128, 256, 64), "float32": (128, 128, 32)}
TUNED_ARCHES = ("sm89", "sm90", "sm100")   # _get_tuned_matmul_arch_family: ada, hopper, blackwell


@record
class MatmulShape:
    n: int
    k: int
    tuned: bool
    block_k: int
    block_m: dict     # bucket max_m -> BLOCK_M (tuned shapes)
    block_n: dict     # bucket max_m -> BLOCK_N


@record
class GemmFacts:
    max_num_batched_tokens: int
    stock_backend: str          # "cublas" or "triton": what the engine uses by itself
    bucket_max_m: tuple         # the tuned table's M buckets (shared by its shapes); () without a table
    default_block_m: int
    default_block_n: int
    default_block_k: int
    qkv: MatmulShape            # per-rank (N, K) of each projection
    o: MatmulShape
    mlp_in: MatmulShape         # dense: gate_up; MoE: the router
    mlp_out: MatmulShape        # dense: down; MoE: the router again (an MoE layer has no dense down_proj)
    lm_head: MatmulShape


@record
class GemmChoice:
    backend: str
    cublas_m: int
    m_bucket: int
    qkv_block_m: int
    qkv_block_n: int
    qkv_block_k: int
    o_block_m: int
    o_block_n: int
    o_block_k: int
    mlp_in_block_m: int
    mlp_in_block_n: int
    mlp_in_block_k: int
    mlp_out_block_m: int
    mlp_out_block_n: int
    mlp_out_block_k: int
    lm_head_block_m: int
    lm_head_block_n: int
    lm_head_block_k: int


def facts(dep: Deployment) -> GemmFacts:
    """The linear layers of a deployment, per TP rank (plain Python, not SelIR)."""
    m, e, tp = dep.model, dep.engine, dep.parallel.tensor_parallel_size
    head_dim = m.head_dim
    # the table is read for bf16 on ada / hopper / blackwell (batch_invariant_configs.py)
    use_table = m.dtype == "bfloat16" and dep.arch in TUNED_ARCHES

    def shape(n: int, k: int) -> MatmulShape:
        tuned = dep.tables.matmul_shape(n, k) if use_table else None
        if tuned is None:
            return MatmulShape(n, k, False, DEFAULT_TILES[m.dtype][2], {}, {})
        return MatmulShape(n, k, True, tuned.block_k, {b.max_m: b.block_m for b in tuned.buckets},
                           {b.max_m: b.block_n for b in tuned.buckets})

    qkv = shape((dep.num_heads_per_rank + 2 * dep.num_kv_heads_per_rank) * head_dim, m.hidden_size)
    o = shape(m.hidden_size, dep.num_heads_per_rank * head_dim)
    if m.is_moe:
        mlp_in = mlp_out = shape(m.num_experts, m.hidden_size)
    else:
        mlp_in = shape(2 * m.intermediate_size // tp, m.hidden_size)
        mlp_out = shape(m.hidden_size, m.intermediate_size // tp)
    lm_head = shape(m.vocab_size // tp, m.hidden_size)
    shapes = (qkv, o, mlp_in, mlp_out, lm_head)
    bucket_lists = {tuple(s.block_m) for s in shapes if s.tuned}
    if len(bucket_lists) > 1:
        raise BadDeployment(f"{dep.name}: [tables.matmul] shapes of this model use different M buckets",
                            remedy="give every tuned shape of the model the same max_m list, as vLLM does")
    tuned_any = bool(bucket_lists)
    # vLLM batch-invariant mode: the Triton matmul on the SM80 family or for tuned shapes (else cuBLAS with
    # split-K disabled); SGLang deterministic mode: the vendored persistent Triton matmul; stock: cuBLAS
    triton = e.batch_invariant and (e.name == "sglang" or dep.arch == "sm80" or tuned_any)
    block_m, block_n, block_k = DEFAULT_TILES[m.dtype]
    return GemmFacts(
        max_num_batched_tokens=e.max_num_batched_tokens, stock_backend="triton" if triton else "cublas",
        bucket_max_m=tuple(sorted(next(iter(bucket_lists)))) if tuned_any else (),
        default_block_m=block_m, default_block_n=block_n, default_block_k=block_k,
        qkv=qkv, o=o, mlp_in=mlp_in, mlp_out=mlp_out, lm_head=lm_head)


@program(family="gemm")
def gemm(d: GemmFacts, num_tokens: Runtime[int], num_tokens_actual: Unpinnable[int]) -> GemmChoice:
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    assume(1 <= num_tokens_actual <= d.max_num_batched_tokens, "the rows the kernel computes")
    choice = knob("gemm.backend", ("stock", "cublas", "triton"), "stock")
    pad = knob("gemm.pad_rows", (1, 16, 32, 64, 128, 256), 1)
    backend = d.stock_backend if choice == "stock" else choice
    m_rows = round_up(num_tokens, pad)           # padding rows are zeros, dropped after the call
    cublas_m = m_rows if backend == "cublas" else 0
    require(backend != "cublas" or cublas_m >= num_tokens_actual,
            "cuBLAS is called with every row of the batch")
    bucket = m_bucket(d, m_rows)
    qkv_m, qkv_n, qkv_k = tile(d, d.qkv, bucket)
    o_m, o_n, o_k = tile(d, d.o, bucket)
    in_m, in_n, in_k = tile(d, d.mlp_in, bucket)
    out_m, out_n, out_k = tile(d, d.mlp_out, bucket)
    head_m, head_n, head_k = tile(d, d.lm_head, bucket)
    return GemmChoice(backend=backend, cublas_m=cublas_m, m_bucket=bucket,
                      qkv_block_m=qkv_m, qkv_block_n=qkv_n, qkv_block_k=qkv_k,
                      o_block_m=o_m, o_block_n=o_n, o_block_k=o_k,
                      mlp_in_block_m=in_m, mlp_in_block_n=in_n, mlp_in_block_k=in_k,
                      mlp_out_block_m=out_m, mlp_out_block_n=out_n, mlp_out_block_k=out_k,
                      lm_head_block_m=head_m, lm_head_block_n=head_n, lm_head_block_k=head_k)


def m_bucket(d, m):
    # _get_matmul_config: the first bucket with max_m >= M, else the last ("values above the tuned range
    # reuse the largest bucket"); 0 without a tuned table
    if len(d.bucket_max_m) == 0:
        return 0
    bucket = d.bucket_max_m[len(d.bucket_max_m) - 1]
    for max_m in d.bucket_max_m:
        if max_m >= m:
            bucket = max_m
            break
    return bucket


def tile(d, shape, bucket):
    # _get_matmul_config: a tuned shape takes BLOCK_M / BLOCK_N from the bucket and its shape-wide BLOCK_K
    # ("shape-wide BLOCK_K keeps this batch-invariant"); any other shape the default config
    if shape.tuned:
        return shape.block_m[bucket], shape.block_n[bucket], shape.block_k
    return d.default_block_m, d.default_block_n, d.default_block_k
