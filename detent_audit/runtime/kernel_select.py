"""The runner's KernelSet for each mode, and the embedded engine's deployment facts.

- `stock`: torch's own kernels on the whole batch (vendor selection reads the batch);
- `det`: one conservative setting per family (what deterministic modes do);
- `detent`: the embedded SelIR programs solved for this engine's deployment, compiled with the committed
  tuple's pins as constants: the KernelSet's selectors are the compiled selectors, called at every kernel
  launch with the launch's runtime inputs.

On a CPU the GEMM's "pad" and "row" forms are legal only where `kernels.gemm_probe` proves them at start, on
the model's own GEMM shapes and the engine's thread count: the committed form is probed before the solve
(a failure refuses to start, naming the tuple and the failing M), and the deployment facts record what the
probe proved (`engine.gemm_pad_rows`, `engine.gemm_row_form`), so a verifier's facts match only where its
own probe proved the same form. Without a tuple the engine commits the pad form at the fewest rows the probe
proves (4 at one thread on the CPU of benchmarks/RESULTS.md), else the 16-row chunk. A tuple written before
the forms existed names no form: it means the chunk form, as it did.

What a receipt signs of the tuple is what the kernels use (`Selection.used_tuple`): an axis of a family's
assignment is kept only where another legal value of it changes the params the KernelSet gives its kernels
over a probe of the deployment's runtime inputs (`used_axes`). An axis no kernel reads (a knob whose result a
pin overrides, a split stride the pinned tiles per split replace) changes no bit, so it is not signed, and a
receipt that names one is not comparable. `Selection.kernel_params` are the params the kernels get over the
probe; the node checks before each signature that the kernels were called with none other
(`KernelSet.params_called`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from detent_audit import __version__, isa
from detent_audit.enums import Mode
from detent_audit.errors import BadInput, DetentError
from detent_audit.kernels import (
    AttentionParams,
    GemmParams,
    Kernels,
    KernelSet,
    MoeParams,
    fixed_order_implementations,
    gemm_probe,
    params_list,
)
from detent_audit.kernels.params import BadParams
from detent_audit.manifests.deployment import Deployment
from detent_audit.runtime.model_config import ModelConfig
from detent_audit.selection.cache import JitCache
from detent_audit.selection.compiler import SolveResult, solve
from detent_audit.selection.errors import IllegalAssignment
from detent_audit.selection.lang import cdiv
from detent_audit.selection.programs import fa3, families_for
from detent_audit.selection.programs.embedded import GPU_MAX_SPLITS

# What the embedded engine commits when no tuple is given: chosen by `benchmarks/engine_cpu.py` on CPU
# (a fixed 16-row GEMM chunk costs little over stock at decode batch sizes; 64-token KV tiles; splits of
# 4096 tokens). The nearest legal assignment is taken, so a deployment whose legal set differs still works.
EMBEDDED_PREFERENCES: dict[str, dict[str, Any]] = {
    "embedded.gemm": {"chunk_rows": 16, "embedded.gemm.chunk_rows": 16, "embedded.gemm.form": "chunk"},
    "embedded.attention": {"embedded.attention.kv_tile": 64, "embedded.attention.split_stride": 4096,
                           "tiles_per_split": 64},
    "embedded.moe": {"chunk_rows": 16, "embedded.moe.chunk_rows": 16},
}
# On a GPU with the streaming fold: splits of 64 tokens, or of the shortest power-of-two multiple of that
# which keeps a sequence of the deployment's longest context within the GPU kernel's split bound. A batch of
# a few rows then reads its KV in parallel programs: on the H200, Llama-3.1-8B decode at batch 1 from a CUDA
# graph is 3.6% faster than at 4096, and at 8-256 rows 1.2-1.9% slower (benchmarks/gpu_attention_strides.py;
# RESULTS.md, "GPU decode loop").
GPU_STREAMING_KV_TILE, GPU_STREAMING_STRIDE = 64, 64


def streaming_stride(max_model_len: int) -> int:
    """The streaming GPU kernel's default split stride for a deployment of `max_model_len`."""
    stride = GPU_STREAMING_STRIDE
    while cdiv(max_model_len, stride) > GPU_MAX_SPLITS:
        stride *= 2
    return stride


def preferences(deployment: Deployment) -> dict[str, dict[str, Any]]:
    """What the embedded engine commits when no tuple is given, per family: EMBEDDED_PREFERENCES, with the
    streaming GPU kernel's own stride (only the GPU kernel has the streaming fold)."""
    if deployment.engine.attention_backend != "detent-streaming":
        return EMBEDDED_PREFERENCES
    stride = streaming_stride(deployment.engine.max_model_len)
    tile = GPU_STREAMING_KV_TILE
    attention = {"embedded.attention.kv_tile": tile, "embedded.attention.split_stride": stride,
                 "tiles_per_split": stride // tile}
    return {**EMBEDDED_PREFERENCES, "embedded.attention": attention}


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels dispatch to here ("AVX2", "AVX512", ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def engine_deployment(config: ModelConfig, *, dtype: str, num_threads: int, block_size: int,
                      max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                      prefix_caching: bool, name: str = "embedded", attention_backend: str = "detent",
                      batch_invariant: bool = True, tensor_parallel_size: int = 1) -> Deployment:
    """The embedded engine's deployment facts, in the shipped files' schema (`batch_invariant`: False for
    stock mode, whose kernels read the batch)."""
    data = {
        "name": name, "description": "the embedded detent engine on a CPU",
        "model": {"name": name, "architecture": config.architecture, "num_layers": config.num_hidden_layers,
                  "hidden_size": config.hidden_size, "num_heads": config.num_attention_heads,
                  "num_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                  "intermediate_size": config.intermediate_size, "num_experts": config.num_experts,
                  "num_experts_per_tok": config.num_experts_per_tok,
                  "moe_intermediate_size": config.moe_intermediate_size, "vocab_size": config.vocab_size,
                  "max_position_embeddings": config.max_position_embeddings, "sliding_window": 0,
                  "dtype": dtype},
        "cpu": {"capability": cpu_capability(), "num_threads": num_threads},
        "engine": {"name": "detent", "version": __version__, "attention_backend": attention_backend,
                   "uses_vllm_fa_fork": False, "page_size": block_size, "max_model_len": max_model_len,
                   "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "cuda_graph_capture_sizes": [], "full_cuda_graph": False,
                   "fa_max_num_splits_for_cuda_graph": 0, "prefix_caching": prefix_caching,
                   "chunked_prefill": True, "batch_invariant": batch_invariant, "custom_all_reduce": False,
                   "custom_all_reduce_algo": "auto", "nccl_symm_mem": False, "torch_symm_mem": False,
                   "flashinfer_all_reduce": False},
        "parallel": {"tensor_parallel_size": tensor_parallel_size},
        "tables": {"fused_moe": {}, "matmul": []},
    }
    return Deployment.from_canonical(data, source="the embedded engine")


@dataclass(frozen=True)
class Selection:
    """The solved families, the committed tuple and the KernelSet built from them."""

    kernels: Kernels
    # family -> axis -> value ({} outside detent mode): what was loaded
    tuple: dict[str, dict[str, Any]]
    results: dict[str, SolveResult]
    deployment: Deployment | None = None      # the facts selection was solved for (with the GEMM probe's)
    used_tuple: dict[str, dict[str, Any]] = field(default_factory=dict)  # the axes the kernels read: signed
    # kernel family -> params over the probe
    kernel_params: dict[str, list[dict]] = field(default_factory=dict)


def nearest_legal(result: SolveResult, preferences: Mapping[str, Any]) -> dict[str, Any]:
    """The legal assignment matching most preferences, then closest to them (ties: the first)."""
    return nearest_legal_of(result.legal_assignments(), preferences, result.program)


def nearest_legal_of(assignments: Any, preferences: Mapping[str, Any], program: str) -> dict[str, Any]:
    """Of `assignments`, the one matching most preferences, then closest to them (ties: the first)."""
    def score(assignment: dict) -> tuple:
        matches = sum(assignment.get(k) == v for k, v in preferences.items())
        distance = sum(abs(assignment[k] - v) for k, v in preferences.items()
                       if k in assignment and isinstance(v, (int, float))
                       and isinstance(assignment[k], (int, float)))
        return (-matches, distance)

    best = min(assignments, key=score, default=None)
    if best is None:
        raise BadInput(f"{program}: no legal assignment for this deployment")
    return best


GEMM_FORM_KNOB = "embedded.gemm.form"


def committed_gemm(committed: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any] | None:
    """The tuple's embedded.gemm assignment, a tuple from before the forms read as the chunk form (None:
    the tuple commits none)."""
    if not committed or "embedded.gemm" not in committed:
        return None
    return {GEMM_FORM_KNOB: "chunk", **committed["embedded.gemm"]}


def gemm_params_of(assignment: Mapping[str, Any]) -> GemmParams:
    """The kernel parameters an embedded.gemm assignment launches with (its pin and form)."""
    try:
        return GemmParams(assignment["chunk_rows"], assignment.get(GEMM_FORM_KNOB, "chunk"))
    except KeyError as exc:
        raise IllegalAssignment(f"the tuple's embedded.gemm assignment {dict(assignment)} names no {exc}",
                                remedy="run `detent-audit solve` for the legal values") from None
    except BadParams as exc:
        raise IllegalAssignment(f"the tuple's embedded.gemm assignment {dict(assignment)} is not legal: "
                                f"{exc.message}", remedy=exc.remedy) from None


def proven_deployment(deployment: Deployment, gemm: dict[str, Any] | None, shapes: Iterable[tuple[int, int]],
                      ) -> tuple[Deployment, dict[str, Any] | None]:
    """Probe the GEMM form the engine is about to commit on `shapes` (N, K) and record what the probe proved
    in the deployment facts; without a committed assignment, choose the pad form at the fewest proven rows
    (else keep the preferences' chunk). Raises `GemmFormNotInvariant` where a committed form fails."""
    import torch

    dtype = getattr(torch, deployment.model.dtype)
    shapes = tuple(shapes)
    if gemm is None and isa.capped() and dtype == torch.float32:
        # under the portable ISA setting the bits may not depend on the CPU: the product whose order the
        # project writes out (MKL's blocking reads the CPU's vendor and caches, docs/isa.md), no probe's rows
        gemm = {"chunk_rows": 1, "embedded.gemm.chunk_rows": 1, GEMM_FORM_KNOB: "fixed"}
    if gemm is None:
        rows = 0 if isa.capped() else gemm_probe.least_pad_rows(shapes, dtype)
        if not rows:
            return deployment, None
        gemm = {"chunk_rows": rows, "embedded.gemm.chunk_rows": rows, GEMM_FORM_KNOB: "pad"}
    params = gemm_params_of(gemm)
    gemm_probe.require(params, shapes, dtype, what=f"the tuple's ({params.label})")
    engine = dataclasses.replace(deployment.engine,
                                 gemm_pad_rows=params.chunk_rows if params.form == "pad" else 0,
                                 gemm_row_form=params.form == "row")
    return dataclasses.replace(deployment, engine=engine), gemm


def runs_fixed_order(selection: Selection | None, dtype: str, attention: str = "c") -> bool:
    """Whether a CPU engine's every product, its attention and SiLU are the portable setting's fixed-order C
    kernels: under the cap, in detent mode (a selection), in float32, the tuple's GEMM form `fixed`, the C
    attention and no MoE experts (whose products stay the BLAS's chunk form)."""
    if selection is None or not isa.capped() or dtype != "float32" or attention != "c":
        return False
    gemm = committed_gemm(selection.tuple) or {}
    return gemm.get(GEMM_FORM_KNOB) == "fixed" and "embedded.moe" not in selection.tuple


def order_facts(fixed_order: bool) -> dict[str, Any]:
    """The runtime facts that say whose order a CPU engine's sums take beyond the ISA: under the portable cap,
    the fixed-order kernels' versions (`fixed_order`: the same bits on every x86-64 CPU) where the engine runs
    them all (`runs_fixed_order`), else the CPU model (`cpu_model`: the BLAS chooses its code by the CPU
    whatever the cap, docs/isa.md); natively nothing (the ISA fact already names the CPU's class). Under the
    cap also the C library (`libc`): torch's log_softmax takes its scalar log of each row's sum."""
    if not isa.capped():
        return {}
    import platform

    name, version = platform.libc_ver()
    libc = {"libc": f"{name} {version}".strip() or "unknown"}
    return {**({"fixed_order": fixed_order_implementations()} if fixed_order else isa.blas_cpu()), **libc}


def select_kernels(mode: str, deployment: Deployment,
                   committed: Mapping[str, Mapping[str, Any]] | None = None,
                   cache_dir: str | Path | None = None, device: str = "cpu",
                   gemm_shapes: Iterable[tuple[int, int]] | None = None) -> Selection:
    """The KernelSet for `mode`; in detent mode the committed tuple (or the preferred legal one). On a CPU,
    `gemm_shapes` (the model's GEMM weights, (N, K)) are what the GEMM form is probed on; the Selection's
    `deployment` is `deployment` with the probe's facts."""
    if device != "cpu":
        return _gpu_selection(mode, deployment, committed, cache_dir)
    if mode == Mode.STOCK:
        return Selection(KernelSet.stock(), {}, {}, deployment)
    if mode == Mode.DET:
        det = KernelSet.det()
        return Selection(det, {}, {}, deployment, {}, probe_params(det, probe_inputs(deployment)))
    if mode != Mode.DETENT:
        raise BadInput(f"unknown mode {mode!r}", remedy="choose detent, stock or det")
    committed = dict(committed or {})
    gemm = committed_gemm(committed)
    if gemm_shapes is not None:
        deployment, gemm = proven_deployment(deployment, gemm, gemm_shapes)
    if gemm is not None:
        committed["embedded.gemm"] = gemm
    cache = JitCache(cache_dir)
    results = {spec.name: solve(spec.program, spec.facts(deployment), cache=cache, family=spec.name)
               for spec in families_for(deployment)}
    unknown = sorted(set(committed) - set(results))
    if unknown:
        raise IllegalAssignment(f"the tuple names families {unknown} this deployment does not run",
                                remedy=f"families: {sorted(results)}")
    chosen: dict[str, dict[str, Any]] = {}
    prefs = preferences(deployment)
    for family, result in results.items():
        if family in committed:
            chosen[family] = _complete(result, family, dict(committed[family]), prefs.get(family, {}))
        else:
            chosen[family] = nearest_legal(result, prefs.get(family, {}))
    selectors = {family: results[family].selector(chosen[family]) for family in results}
    probe = probe_inputs(deployment)
    used = used_axes(results, chosen, selectors, probe)
    # the portable ISA setting's attention and SiLU: the C kernels, their order written out (docs/isa.md)
    return Selection(_kernel_set(selectors, fixed_order=isa.capped()), chosen, results, deployment, used,
                     probe_params(_kernel_set(selectors), probe))


def _complete(result: SolveResult, family: str, given: dict[str, Any], preferred: Mapping[str, Any]
              ) -> dict[str, Any]:
    """A committed assignment made whole: as given when it names every axis, else the legal assignment that
    agrees with every axis given and is nearest the preferences on the others (a receipt's tuple names only
    the axes the kernels read); `BadInput` when none is legal."""
    unknown = sorted(set(given) - set(result.axes))
    given = _attention_pin(family, given, preferred, result.axes)
    if not unknown:
        if set(given) == set(result.axes):
            if result.is_legal(given):
                return given
        else:
            prefs = {**preferred, **given}
            matching = [a for a in result.legal_assignments() if all(a[k] == v and type(a[k]) is type(v)
                                                                      for k, v in given.items())]
            if matching:
                return nearest_legal_of(matching, prefs, result.program)
    raise IllegalAssignment(f"the tuple's {family} assignment {given} is not legal" +
                            (f" (no axes {unknown})" if unknown else ""),
                            remedy="run `detent-audit solve` for the legal values")


def _attention_pin(family: str, given: dict[str, Any], preferred: Mapping[str, Any], axes: Any
                   ) -> dict[str, Any]:
    """A committed attention assignment that names the split stride (the knob) but not the pinned tiles per
    split, with the pin that stride means (stride / KV tile): the kernels read the pin, so a pin taken from
    the preferences would run another stride than the one named."""
    stride_knob, tile_knob = "embedded.attention.split_stride", "embedded.attention.kv_tile"
    if family != "embedded.attention" or "tiles_per_split" not in axes or "tiles_per_split" in given:
        return given
    stride, tile = given.get(stride_knob), given.get(tile_knob, preferred.get(tile_knob))
    if not isinstance(stride, int) or not isinstance(tile, int) or stride <= 0 or stride % tile:
        return given
    return {**given, "tiles_per_split": stride // tile}


def probe_inputs(deployment: Deployment) -> dict[str, list[dict[str, int]]]:
    """Runtime inputs of each kernel family's selector that `used_axes` tries: a step's token counts, a
    batch's sequence counts and KV lengths, around the powers of two (where tiles and chunks change) and at
    the deployment's limits."""
    e = deployment.engine

    def around(top: int) -> list[int]:
        points = {1, top}
        for k in range(1, top.bit_length() + 1):
            points |= {(1 << k) - 1, 1 << k, (1 << k) + 1}
        return sorted(x for x in points if 1 <= x <= top)

    tokens, seqs, lens = around(e.max_num_batched_tokens), around(e.max_num_seqs), around(e.max_model_len)
    moe = {"moe": [{"num_tokens": n} for n in tokens]} if deployment.model.num_experts else {}
    return {"gemm": [{"num_tokens": n} for n in tokens], **moe,
            "attention": [{"num_seqs": s, "max_seqlen_q": 1, "max_seqlen_k": k}
                          for s in (seqs[0], seqs[len(seqs) // 2], seqs[-1]) for k in lens]}


def probe_params(kernels: KernelSet, probe: Mapping[str, list[dict[str, int]]]) -> dict[str, list[dict]]:
    """kernel family -> the params its selector gives over `probe` (sorted dicts; none in stock mode)."""
    select = {"gemm": kernels.select_gemm, "attention": kernels.select_attention, "moe": kernels.select_moe}
    out = {}
    for family, inputs in probe.items():
        values = {select[family](**x) for x in inputs} - {None}
        if values:
            out[family] = params_list(values)
    return out


def used_axes(results: Mapping[str, SolveResult], chosen: Mapping[str, Mapping[str, Any]],
              selectors: Mapping[str, Any], probe: Mapping[str, list[dict[str, int]]], tries: int = 12
              ) -> dict[str, dict[str, Any]]:
    """Per family, the axes of its chosen assignment that some other legal value of changes what the kernels
    are called with over `probe`. Tried: every other legal value of an axis with few, else up to `tries`
    spread over them (the ends, the middle, the neighbours); a value the kernels refuse (a chunk that is not
    a power of two) is no alternative. An axis with no alternative is kept (no tuple can change it)."""
    base = probe_params(_kernel_set(dict(selectors)), probe)
    used: dict[str, dict[str, Any]] = {}
    for family, assignment in chosen.items():
        result = results[family]
        legal = {**{p.name: p.legal_values for p in result.pins},
                 **{k.name: k.legal_values for k in result.knobs}}
        used[family] = {}
        for axis in result.axes:
            others = [v for v in legal.get(axis) or [] if v != assignment[axis]]
            if len(others) > tries:
                at = next((i for i, v in enumerate(others) if isinstance(v, (int, float))
                           and v > assignment[axis]), len(others))
                picks = [0, len(others) - 1, at - 1, at,
                         *(len(others) * j // (tries - 3) for j in range(1, tries - 3))]
                others = [others[i] for i in dict.fromkeys(i for i in picks if 0 <= i < len(others))]
            alternatives = 0
            for value in others:
                candidate = {**assignment, axis: value}
                if not result.is_legal(candidate):
                    continue
                try:
                    got = probe_params(_kernel_set({**selectors, family: result.selector(candidate)}), probe)
                except DetentError:
                    continue  # the kernels refuse it: a tuple cannot name it either
                alternatives += 1
                if got != base:
                    break
            else:
                if alternatives:
                    continue  # no alternative changes a kernel's params: the axis is not read
            used[family][axis] = assignment[axis]
    return used


def _gpu_selection(mode: str, deployment: Deployment, committed: Any, cache_dir: Any) -> Selection:
    """On a GPU, detent's attention selector is the same compiled embedded selector (called per launch), det
    is one split with a fixed tile, stock reads the batch (FA3's split program unpinned, vLLM's MoE rule by
    M)."""
    import torch

    from detent_audit.kernels.gpu import GpuKernelSet

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    streaming = deployment.engine.attention_backend == "detent-streaming"
    if mode == Mode.STOCK:
        stock = GpuKernelSet(Mode.STOCK, stock_attention_selector(deployment, sms))
        return Selection(stock, {}, {}, deployment)
    if mode == Mode.DET:
        det = AttentionParams(kv_tile=64, split_stride=0)
        return Selection(GpuKernelSet(Mode.DET, lambda **_: det, _det_moe_config(deployment), streaming),
                         {}, {}, deployment)
    # detent's MoE tile follows M as stock's does (kernels.gpu.moe_tile): the tile does not change the bits
    # the GPU kernels read the attention selector alone (GEMM and MoE tiles by shape): only its axes are
    # signed
    cpu = select_kernels(Mode.DETENT, deployment, committed, cache_dir)
    used = {f: a for f, a in cpu.used_tuple.items() if f == "embedded.attention"}
    params = {f: p for f, p in cpu.kernel_params.items() if f == "attention"}
    # detent's compiled selector always returns params (only stock's may return none)
    select = cast(Callable[..., AttentionParams], cast(KernelSet, cpu.kernels).select_attention)
    return Selection(GpuKernelSet(Mode.DETENT, select, None, streaming),
                     cpu.tuple, cpu.results, cpu.deployment, used, params)


STOCK_TILE = 64  # stock's Triton attention tile on a GPU: BLOCK_M and the KV tile


def stock_attention_selector(deployment: Deployment, num_sms: int) -> Callable[..., AttentionParams]:
    """Stock's attention on a GPU, per launch: FlashAttention-3's split count as its SelIR program computes it
    (selection/programs/fa3.py, `static_num_splits`: the heuristic unpinned, as a stock engine calls it),
    evaluated on the launch's batch over the Triton kernel's 64 x 64 tile; each sequence's KV is cut into that
    many runs of whole tiles, so split boundaries move with the batch. Memoised on the batch shape: every
    layer of a step asks with the same values."""
    facts = dataclasses.replace(fa3.facts(deployment), num_sms=num_sms, num_splits_arg=0,
                                graph_num_splits_arg=0, max_cuda_graph_size=0)

    @functools.lru_cache(maxsize=4096)
    def select(num_seqs: int, max_seqlen_q: int, max_seqlen_k: int) -> AttentionParams:
        is_causal, is_local = fa3.attention_flags(facts, max_seqlen_q, max_seqlen_k)
        splits = fa3.static_num_splits(facts, False, facts.varlen, num_seqs, max_seqlen_q, max_seqlen_k,
                                       STOCK_TILE, STOCK_TILE, is_causal, is_local)
        stride = STOCK_TILE * cdiv(cdiv(max_seqlen_k, STOCK_TILE), splits) if splits > 1 else 0
        return AttentionParams(kv_tile=STOCK_TILE, split_stride=stride)

    def select_attention(*, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int) -> AttentionParams:
        return select(num_seqs, max_seqlen_q, max_seqlen_k)

    return select_attention


def _det_moe_config(deployment: Deployment) -> Any:
    """det's one fused-MoE tile, never from M (None without experts)."""
    if not deployment.model.num_experts:
        return None
    from detent_audit.kernels.triton_moe import TritonMoeConfig

    return TritonMoeConfig()


def _kernel_set(selectors: dict[str, Any], fixed_order: bool = False) -> KernelSet:
    gemm_fn = selectors["embedded.gemm"].fn
    attn_fn = selectors["embedded.attention"].fn
    moe_fn = selectors["embedded.moe"].fn if "embedded.moe" in selectors else gemm_fn
    gemm_params: dict[tuple[int, str], GemmParams] = {}
    attn_params: dict[tuple[int, int], AttentionParams] = {}

    def gemm_of(chunk_rows: int, form: str = "chunk") -> GemmParams:
        params = gemm_params.get((chunk_rows, form))
        if params is None:
            params = gemm_params.setdefault((chunk_rows, form), GemmParams(chunk_rows, form))
        return params

    def select_gemm(num_tokens: int) -> GemmParams:
        choice = gemm_fn(num_tokens)
        return gemm_of(choice.chunk_rows, choice.form)

    def select_attention(num_seqs: int, max_seqlen_q: int, max_seqlen_k: int) -> AttentionParams:
        choice = attn_fn(num_seqs, max_seqlen_k, max_seqlen_k)
        key = (choice.kv_tile, choice.tiles_per_split * choice.kv_tile)
        params = attn_params.get(key)
        if params is None:
            params = attn_params.setdefault(key, AttentionParams(kv_tile=key[0], split_stride=key[1]))
        return params

    def select_moe(num_tokens: int) -> MoeParams:
        return MoeParams(gemm=gemm_of(moe_fn(num_tokens).chunk_rows))

    return KernelSet(Mode.DETENT, select_gemm, select_attention, select_moe, fixed_order)
