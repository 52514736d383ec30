"""Deployment facts: what the solver knows about a serving deployment before the first request.

A `Deployment` is the static half of every SelIR program's input (docs/design.md section 3): the model's
shape, the GPU, the engine's settings, the parallel layout and the engine's tuned tables. It is loaded from a
TOML file (`manifests/deployments/*.toml`, one section per record below), validated on construction, and
hashed canonically so a receipt can name the exact facts its tuple was solved for.

Invariants of a `Deployment` that exists: every field has its declared type (no floats anywhere, so the
canonical form is receipt-safe), counts are positive, head counts fit the tensor-parallel degree, tables
are sorted by key. Every violation is a `BadDeployment` naming the file, the section and the field.
This module imports neither torch nor the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from detent_audit.errors import BadInput
from detent_audit.manifests.encoding import JsonValue, canonical_json, facts_hash

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ENGINES = ("vllm", "sglang", "detent")
ATTENTION_BACKENDS = ("fa3", "fa2", "flashinfer", "triton", "detent", "detent-streaming")
# arch -> the compute capabilities it covers
ARCH_CAPABILITIES = {"sm80": ("8.0", "8.6"), "sm89": ("8.9",), "sm90": ("9.0",), "sm100": ("10.0", "10.3"),
                     "sm120": ("12.0",)}
CPU = "cpu"  # `Deployment.arch` of a deployment on a CPU (its [cpu] record)


class BadDeployment(BadInput):
    """A deployment-facts file (or canonical dict) is malformed, incomplete or inconsistent.

    `located` is False while the message still lacks its `[section]` (a record's own check); the loader adds
    the section, then the file name.
    """

    remedy = "fix the deployment file; every file in manifests/deployments/ is a complete example"

    def __init__(self, message: str, *, remedy: str | None = None, located: bool = True) -> None:
        super().__init__(message, remedy=remedy)
        self.located = located


def check(ok: bool, message: str, remedy: str = "correct the value", section: str | None = None) -> None:
    """Raise `BadDeployment(message)` unless `ok`; `section` locates a cross-section check itself."""
    if not ok:
        if section is None:
            raise BadDeployment(message, remedy=remedy, located=False)
        raise BadDeployment(f"[{section}] {message}", remedy=remedy)


def _positive(record: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(record, name)
        check(value > 0, f"{name} ({value}) must be positive", f"set {name} to a positive integer")


@dataclass(frozen=True)
class ModelFacts:
    """The model's architecture, as its config.json states it (whole model, before sharding)."""

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int             # 0 = dense
    num_experts_per_tok: int     # 0 when dense
    moe_intermediate_size: int   # 0 when dense
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int          # 0 = full attention
    dtype: str

    def __post_init__(self) -> None:
        _positive(self, ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                         "intermediate_size", "vocab_size", "max_position_embeddings"))
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "sliding_window"):
            check(getattr(self, name) >= 0, f"{name} ({getattr(self, name)}) must not be negative")
        check(self.num_heads % self.num_kv_heads == 0,
              f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
              "take both head counts from the model's config.json")
        if self.num_experts == 0:
            check(self.num_experts_per_tok == 0 and self.moe_intermediate_size == 0,
                  "a dense model (num_experts = 0) needs num_experts_per_tok = 0 and moe_intermediate_size = "
                  "0")
        else:
            check(1 <= self.num_experts_per_tok <= self.num_experts,
                  f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                  f"({self.num_experts})")
            check(self.moe_intermediate_size > 0, "an MoE model needs a positive moe_intermediate_size")
        check(self.dtype in DTYPE_BYTES, f"dtype {self.dtype!r} must be one of {sorted(DTYPE_BYTES)}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_parameters(self) -> int:
        """The weights these facts imply (`decoder_parameters`; untied embeddings, no biases: the facts do not
        say, so it is the larger count)."""
        return decoder_parameters(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                  num_layers=self.num_layers, num_heads=self.num_heads,
                                  num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                  intermediate_size=self.intermediate_size, num_experts=self.num_experts,
                                  moe_intermediate_size=self.moe_intermediate_size)


def decoder_parameters(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                       num_kv_heads: int, head_dim: int, intermediate_size: int, num_experts: int = 0,
                       moe_intermediate_size: int = 0, moe_layers: int | None = None,
                       tied_embeddings: bool = False, qkv_bias: bool = False, o_bias: bool = False,
                       qk_norm: bool = False) -> int:
    """The parameter count of a Llama/Qwen decoder: embeddings (and an untied head), per layer attention
    (q, k, v, o; optional biases and per-head q/k norms), two RMSNorms and a gated MLP, or on `moe_layers` of
    them (all, by default, when `num_experts` > 0) a router and `num_experts` gated experts; a final norm."""
    h, q, kv = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv) * qkv_bias + h * o_bias + 2 * head_dim * qk_norm
    dense = 3 * h * intermediate_size
    sparse = num_experts * (3 * h * moe_intermediate_size + h)
    sparse_layers = (num_layers if num_experts else 0) if moe_layers is None else moe_layers
    return (vocab_size * h * (1 if tied_embeddings else 2) + num_layers * (attention + 2 * h)
            + sparse_layers * sparse + (num_layers - sparse_layers) * dense + h)


@dataclass(frozen=True)
class GpuFacts:
    """One GPU of the deployment (a CPU is a [cpu] record, `CpuFacts`)."""

    name: str
    arch: str                 # "sm90", "sm100", ...
    compute_capability: str   # "9.0", "10.0", ...
    num_sms: int              # streaming multiprocessors
    memory_gib: int
    fully_connected: bool     # every pair of devices linked directly (NVLink/NVSwitch all-to-all)

    def __post_init__(self) -> None:
        check(self.arch != CPU, "arch 'cpu': a CPU is described by a [cpu] section (capability, "
              "num_threads), not [gpu]")
        check(self.arch in ARCH_CAPABILITIES,
              f"arch {self.arch!r} must be one of {sorted(ARCH_CAPABILITIES)}")
        expected = ARCH_CAPABILITIES[self.arch]
        check(self.compute_capability in expected, f"compute_capability {self.compute_capability!r} does not "
              f"match arch {self.arch!r} (expected one of {list(expected)})")
        _positive(self, ("num_sms", "memory_gib"))


@dataclass(frozen=True)
class CpuFacts:
    """The CPU a deployment runs on: what its kernels' bits depend on (the instruction set torch dispatches
    to) and split their work over (the engine's threads, fixed at start)."""

    capability: str           # torch's CPU capability: "AVX2", "AVX512", "DEFAULT", ...
    num_threads: int

    def __post_init__(self) -> None:
        check(bool(self.capability), "capability must name the CPU's instruction set (torch's, e.g. AVX2)")
        _positive(self, ("num_threads",))


@dataclass(frozen=True)
class EngineFacts:
    """The serving engine and the settings its kernel selection reads."""

    name: str                              # "vllm" | "sglang" | "detent"
    version: str
    # "fa3", "fa2", "flashinfer", "triton", "detent", "detent-streaming"
    attention_backend: str
    uses_vllm_fa_fork: bool                # FlashAttention from vllm-project/flash-attention
    page_size: int                         # KV-cache tokens per page
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cuda_graph_capture_sizes: tuple[int, ...]
    full_cuda_graph: bool                  # attention captured in full CUDA graphs for graph-sized batches
    fa_max_num_splits_for_cuda_graph: int  # num_splits given to FA inside full graphs (0: FA's heuristic)
    prefix_caching: bool
    chunked_prefill: bool
    batch_invariant: bool                  # VLLM_BATCH_INVARIANT / --enable-deterministic-inference
    custom_all_reduce: bool                # custom all-reduce not disabled
    custom_all_reduce_algo: str            # VLLM_CUSTOM_ALLREDUCE_ALGO: "auto" | "1stage" | "2stage"
    nccl_symm_mem: bool                    # NCCL symmetric-memory all-reduce enabled
    torch_symm_mem: bool                   # torch symmetric-memory all-reduce enabled
    flashinfer_all_reduce: bool            # FlashInfer all-reduce enabled
    nccl_algo: str = ""                    # NCCL_ALGO as set for the server ("": NCCL's tuner picks by size)
    nccl_proto: str = ""                   # NCCL_PROTO ("": NCCL's tuner picks by size)
    nccl_channels: int = 0                 # NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS (0: not pinned)
    # vLLM --disable-cascade-attn: True, vLLM's default since PR #36318 (engine_defaults.py cites it)
    disable_cascade_attn: bool = True
    # the FlashAttention-3 build: "<owner>/<repo>@<commit>" ("": unknown)
    fa3_source: str = ""
    nccl_chain_order: str = ""             # NCCL's per-channel intra-node chain order ("": not recorded)
    # the embedded engine on a CPU: GEMM forms a probe proved batch-invariant where it runs
    # (kernels/gemm_probe.py)
    gemm_pad_rows: int = 0                 # one product padded to >= this many rows (0: not proven)
    gemm_row_form: bool = False            # every row its own one-row product

    def __post_init__(self) -> None:
        check(self.name in ENGINES, f"name {self.name!r} must be one of {list(ENGINES)}")
        check(self.attention_backend in ATTENTION_BACKENDS,
              f"attention_backend {self.attention_backend!r} must be one of {list(ATTENTION_BACKENDS)}")
        _positive(self, ("page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"))
        check(self.max_num_batched_tokens >= self.max_num_seqs, f"max_num_batched_tokens "
              f"({self.max_num_batched_tokens}) must be at least max_num_seqs ({self.max_num_seqs})")
        check(self.chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
              "without chunked prefill, max_num_batched_tokens must hold a whole max_model_len prompt")
        sizes = self.cuda_graph_capture_sizes
        check(all(s > 0 for s in sizes) and list(sizes) == sorted(set(sizes)),
              "cuda_graph_capture_sizes must be positive and strictly increasing")
        check(not self.full_cuda_graph or len(sizes) > 0, "full_cuda_graph needs cuda_graph_capture_sizes")
        check(self.fa_max_num_splits_for_cuda_graph >= 0,
              "fa_max_num_splits_for_cuda_graph must not be negative (0: FlashAttention's heuristic)")
        check(self.custom_all_reduce_algo in ("auto", "1stage", "2stage"),
              f"custom_all_reduce_algo {self.custom_all_reduce_algo!r} must be 'auto', '1stage' or '2stage'")
        check(self.nccl_channels >= 0, "nccl_channels must not be negative (0: not pinned)")
        check(self.gemm_pad_rows >= 0, "gemm_pad_rows must not be negative (0: not proven)")
        check(self.fa3_source == "" or ("/" in self.fa3_source and "@" in self.fa3_source),
              f"fa3_source {self.fa3_source!r} must read <owner>/<repo>@<commit>")
        check(not self.uses_vllm_fa_fork or self.name == "vllm",
              "uses_vllm_fa_fork: only the vllm engine ships the vLLM FlashAttention fork")

    @property
    def max_cuda_graph_size(self) -> int:
        """The largest captured batch (0 without CUDA graphs)."""
        return max(self.cuda_graph_capture_sizes, default=0)


@dataclass(frozen=True)
class ParallelFacts:
    tensor_parallel_size: int

    def __post_init__(self) -> None:
        _positive(self, ("tensor_parallel_size",))


@dataclass(frozen=True)
class MoeConfigRow:
    """One row of a tuned fused-MoE table (upstream JSON keys BLOCK_SIZE_M ... lower-cased)."""

    block_size_m: int
    block_size_n: int
    block_size_k: int
    group_size_m: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _positive(self, tuple(f.name for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class MatmulBucket:
    """Config of the rows M <= max_m (above the previous bucket) of one tuned matmul shape."""

    max_m: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        _positive(self, tuple(f.name for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class MatmulShapeConfig:
    """A tuned (N, K) shape of the engine's batch-invariant matmul table: one BLOCK_K, M-buckets for the
    rest."""

    n: int
    k: int
    block_k: int
    buckets: tuple[MatmulBucket, ...]

    def __post_init__(self) -> None:
        _positive(self, ("n", "k", "block_k"))
        max_m = [b.max_m for b in self.buckets]
        check(len(max_m) > 0 and max_m == sorted(set(max_m)), "buckets must be non-empty with strictly "
              "increasing max_m")


@dataclass(frozen=True)
class TunedTables:
    """Static tuned tables the engine ships for this deployment (empty where it ships none).

    `fused_moe` is (token count, row) sorted by token count: upstream files are written in that order, so a
    nearest-key tie goes to the smaller key, as upstream's first-in-file rule does.
    """

    fused_moe: tuple[tuple[int, MoeConfigRow], ...] = ()
    matmul: tuple[MatmulShapeConfig, ...] = ()
    fused_moe_down: tuple[tuple[int, MoeConfigRow], ...] = ()  # SGLang's `..._down.json` (down projection)

    def __post_init__(self) -> None:
        for name in ("fused_moe", "fused_moe_down"):
            keys = [k for k, _ in getattr(self, name)]
            check(all(k > 0 for k in keys) and keys == sorted(set(keys)),
                  f"{name} keys must be distinct positive token counts, ascending")
        shapes = [(s.n, s.k) for s in self.matmul]
        check(len(shapes) == len(set(shapes)), "matmul lists a shape (n, k) twice")

    def matmul_shape(self, n: int, k: int) -> MatmulShapeConfig | None:
        """The tuned entry of shape (n, k), or None."""
        return next((s for s in self.matmul if (s.n, s.k) == (n, k)), None)


@dataclass(frozen=True)
class Deployment:
    """A complete, validated set of deployment facts. Build with `load_deployment` or `from_canonical`."""

    name: str
    description: str
    model: ModelFacts
    gpu: GpuFacts | None          # exactly one of gpu and cpu: the device the deployment runs on
    engine: EngineFacts
    parallel: ParallelFacts
    tables: TunedTables = TunedTables()
    cpu: CpuFacts | None = None

    def __post_init__(self) -> None:
        m, e, tp = self.model, self.engine, self.parallel.tensor_parallel_size
        check((self.gpu is None) != (self.cpu is None), "a deployment runs on a GPU or a CPU: give exactly "
              "one of [gpu] and [cpu]")
        check(m.num_heads % tp == 0, f"tensor_parallel_size ({tp}) must divide [model] num_heads "
              f"({m.num_heads})", section="parallel")
        check(m.num_kv_heads % tp == 0 or tp % m.num_kv_heads == 0,
              f"tensor_parallel_size ({tp}) and [model] num_kv_heads ({m.num_kv_heads}) must divide one "
              "another (KV heads are split, or replicated when TP exceeds them)", section="parallel")
        mlp = m.moe_intermediate_size if m.is_moe else m.intermediate_size
        check(mlp % tp == 0, f"tensor_parallel_size ({tp}) must divide the MLP size ({mlp})",
              section="parallel")
        check(tp == 1 or self.arch != CPU or e.name == "detent", "tensor_parallel_size: on a CPU only the "
              "detent engine runs tensor-parallel (its ranks as processes over gloo)", section="parallel")
        check(e.max_model_len <= m.max_position_embeddings, f"max_model_len ({e.max_model_len}) exceeds "
              f"[model] max_position_embeddings ({m.max_position_embeddings})", section="engine")
        check(e.attention_backend != "fa3" or self.arch == "sm90",
              f"attention_backend 'fa3': FlashAttention-3 runs on sm90, not {self.arch}", section="engine")
        check((e.name == "detent") == e.attention_backend.startswith("detent"),
              "attention_backend 'detent' (and 'detent-streaming', its GPU kernel's streaming fold) is "
              "the detent engine's own, and the detent engine uses no other", section="engine")
        check(self.arch != CPU or e.name == "detent", "name: only the detent engine runs on a CPU",
              section="engine")
        check(not self.tables.fused_moe or m.is_moe, "fused_moe: a fused-MoE table needs an MoE model",
              section="tables")
        check(not self.tables.fused_moe_down or bool(self.tables.fused_moe),
              "fused_moe_down: a down-projection table completes an up-projection table ([tables.fused_moe])",
              section="tables")

    @property
    def arch(self) -> str:
        """The GPU's arch ("sm90", ...), or "cpu"."""
        return self.gpu.arch if self.gpu is not None else CPU

    @property
    def device(self) -> GpuFacts:
        """The GPU of a GPU deployment (what GPU selection programs read); `BadDeployment` on a CPU."""
        check(self.gpu is not None, "this deployment runs on a CPU: it has no [gpu] facts")
        assert self.gpu is not None
        return self.gpu

    @property
    def compute_units(self) -> int:
        """What the kernels split their work over: a GPU's SMs, a CPU's threads."""
        if self.gpu is not None:
            return self.gpu.num_sms
        return self.cpu.num_threads if self.cpu is not None else 1

    @property
    def num_heads_per_rank(self) -> int:
        return self.model.num_heads // self.parallel.tensor_parallel_size

    @property
    def num_kv_heads_per_rank(self) -> int:
        return max(1, self.model.num_kv_heads // self.parallel.tensor_parallel_size)

    def to_canonical(self) -> dict[str, JsonValue]:
        """Plain types only, keys sorted, in the TOML file's schema; `from_canonical` inverts it."""
        out: dict[str, JsonValue] = {"name": self.name, "description": self.description}
        for section in ("model", "gpu", "cpu", "engine", "parallel"):
            if getattr(self, section) is not None:
                out[section] = {k: list(v) if isinstance(v, tuple) else v
                                for k, v in dataclasses.asdict(getattr(self, section)).items()}
        out["tables"] = {
            "fused_moe": {str(key): dataclasses.asdict(row) for key, row in self.tables.fused_moe},
            "fused_moe_down": {str(key): dataclasses.asdict(row) for key, row in self.tables.fused_moe_down},
            "matmul": [{"n": s.n, "k": s.k, "block_k": s.block_k,
                        "buckets": [dataclasses.asdict(b) for b in s.buckets]} for s in self.tables.matmul],
        }
        return {k: _sorted_keys(out[k]) for k in sorted(out)}

    def canonical_json(self) -> bytes:
        """The hashed encoding (`encoding.canonical_json`: sorted keys, no whitespace, ASCII)."""
        return canonical_json(self.to_canonical())

    def facts_hash(self) -> str:
        """SHA-256 hex of `canonical_json()` (`encoding.facts_hash`); changes when any fact changes."""
        return facts_hash(self.to_canonical())

    @classmethod
    def from_canonical(cls, data: object, source: str = "<canonical facts>") -> Deployment:
        """Build from a plain dict (a parsed TOML file, a receipt's facts). Raises `BadDeployment`."""
        try:
            return _build(data)
        except BadDeployment as exc:
            raise BadDeployment(f"{source}: {exc.message}", remedy=exc.remedy) from None


def load_deployment(path: str | Path) -> Deployment:
    """Read and validate a deployment-facts TOML file. Raises `BadDeployment` naming the file and field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadDeployment(f"{path.name}: cannot read deployment file ({exc.strerror})",
                            remedy=f"check the path {str(path)!r}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadDeployment(f"{path.name}: not valid TOML: {exc}",
                            remedy="fix the TOML syntax at the line and column shown") from None
    return Deployment.from_canonical(data, source=path.name)


def shipped_deployments() -> dict[str, Path]:
    """Name (file stem) -> path of every deployment file shipped in `manifests/deployments/`, sorted."""
    folder = Path(__file__).parent / "deployments"
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


# ---- parsing: a plain dict -> records, each problem located as "[section] ..." ----

def _build(data: object) -> Deployment:
    top = _parse(_TopLevel, data, None)
    model, engine = _parse(ModelFacts, top.model, "model"), _parse(EngineFacts, top.engine, "engine")
    parallel = _parse(ParallelFacts, top.parallel, "parallel")
    devices = [name for name in ("gpu", "cpu") if isinstance(data, dict) and name in data]
    _require(len(devices) == 1, "missing section [gpu] (or [cpu])" if not devices else
             "both [gpu] and [cpu]: a deployment runs on one kind of device",
             "give exactly one of [gpu] and [cpu]")
    gpu = _parse(GpuFacts, top.gpu, "gpu") if devices == ["gpu"] else None
    cpu = _parse(CpuFacts, top.cpu, "cpu") if gpu is None else None
    tables = _parse_tables(top.tables)
    return Deployment(name=top.name, description=top.description, model=model, gpu=gpu, cpu=cpu,
                      engine=engine, parallel=parallel, tables=tables)


def _moe_rows(data: dict, name: str) -> tuple[tuple[int, MoeConfigRow], ...]:
    moe = data.get(name, {})
    check(isinstance(moe, dict), f"{name} must be a table of `token_count = {{ row }}`",
          f"write it as [tables.{name}] with one `N = {{ block_size_m = ..., ... }}` line per row",
          section="tables")
    rows = []
    for key, row in moe.items():
        check(isinstance(key, str) and key.isdigit() and int(key) > 0,
              f"key {key!r} must be a positive token count",
              "the keys are the token counts the rows were tuned for", section=f"tables.{name}")
        rows.append((int(key), _parse(MoeConfigRow, row, f"tables.{name}.{key}")))
    return tuple(sorted(rows, key=lambda r: r[0]))


def _parse_tables(data: dict) -> TunedTables:
    unknown = sorted(set(data) - {"fused_moe", "fused_moe_down", "matmul"})
    check(not unknown, f"has unknown table {unknown[0]!r}" if unknown else "",
          "the known tables are [tables.fused_moe], [tables.fused_moe_down] and [[tables.matmul]]",
          section="tables")
    rows, down = _moe_rows(data, "fused_moe"), _moe_rows(data, "fused_moe_down")
    shapes = data.get("matmul", [])
    check(isinstance(shapes, list), "matmul must be an array of tables",
          "write each shape as [[tables.matmul]]", section="tables")
    parsed = []
    for i, shape in enumerate(shapes):
        where = f"tables.matmul.{i}"
        head = _parse(_MatmulShapeFields, shape, where)
        buckets = tuple(_parse(MatmulBucket, b, f"{where}.buckets.{j}") for j, b in enumerate(head.buckets))
        build = functools.partial(MatmulShapeConfig, head.n, head.k, head.block_k, buckets)
        parsed.append(_located(build, where))
    return _located(lambda: TunedTables(rows, tuple(parsed), down), "tables")


_T = TypeVar("_T")
_Record = TypeVar("_Record", bound="DataclassInstance")
_TYPE_NAMES: dict[type, str] = {int: "an integer", str: "a string", bool: "true or false", dict: "a table",
                                 list: "an array"}
_KIND_NAMES: dict[type, str] = {**_TYPE_NAMES, float: "a float", bool: "a boolean"}


def _kind(value: object) -> str:
    for t in (bool, int, str, float, dict, list):
        if isinstance(value, t):
            return _KIND_NAMES.get(t, t.__name__)
    return type(value).__name__


def _convert(value: object, hint: object) -> tuple[bool, object]:
    """(ok, value converted to the field's type): exact types only (a bool is not an integer)."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not (isinstance(value, list) and all(type(v) is int for v in value)):
            return False, value
        return True, tuple(value)
    if hint in (int, str, bool):
        return type(value) is hint, value
    if hint is dict or origin is dict:
        return isinstance(value, dict), value
    if hint is list or origin is list:
        return isinstance(value, list), value
    raise TypeError(f"no parser for {hint!r}")  # a programming error in this module, not bad input


def _describe(hint: object) -> str:
    if typing.get_origin(hint) is tuple:
        return "an array of integers"
    origin = typing.get_origin(hint) or hint
    return _TYPE_NAMES.get(origin, str(hint)) if isinstance(origin, type) else str(hint)


def _parse(cls: type[_Record], data: object, section: str | None) -> _Record:
    """Build record `cls` from `data` (a dict from TOML or canonical JSON), each error located."""
    where = f"[{section}]" if section else "the top level"
    if not isinstance(data, dict):
        raise BadDeployment(f"{where} must be a table, not {_kind(data)}",
                            remedy=f"write {where} as a TOML table")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    unknown = sorted(set(data) - set(names))
    if unknown:
        _require(False, f"{where} has unknown field {unknown[0]!r}",
                 f"remove it or correct its spelling; {where} takes: {', '.join(names)}")
    values: dict[str, object] = {}
    for f in fields:
        hint = hints[f.name]
        if f.name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            if hint is dict and section is None:
                _require(False, f"missing section [{f.name}]", f"add a [{f.name}] section")
            _require(False, f"{where} is missing field {f.name!r}",
                     f"add `{f.name} = <{_describe(hint)}>` under {where}")
        ok, value = _convert(data[f.name], hint)
        _require(ok, f"{where} field {f.name!r} must be {_describe(hint)}, not {_kind(data[f.name])} "
                 f"({data[f.name]!r})", f"write {f.name} as {_describe(hint)}")
        values[f.name] = value
    return _located(lambda: cls(**values), section)


def _require(ok: bool, message: str, remedy: str) -> None:
    if not ok:
        raise BadDeployment(message, remedy=remedy)


def _located(build: typing.Callable[[], _T], section: str | None) -> _T:
    """Run a record constructor; a record's own check gets its `[section]` prefix."""
    try:
        return build()
    except BadDeployment as exc:
        if exc.located or section is None:
            raise
        raise BadDeployment(f"[{section}] {exc.message}", remedy=exc.remedy) from None


@dataclass(frozen=True)
class _TopLevel:
    name: str
    description: str
    model: dict
    engine: dict
    parallel: dict
    gpu: dict = dataclasses.field(default_factory=dict)
    cpu: dict = dataclasses.field(default_factory=dict)
    tables: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class _MatmulShapeFields:
    n: int
    k: int
    block_k: int
    buckets: list


def _sorted_keys(value: JsonValue) -> JsonValue:
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value
