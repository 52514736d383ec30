"""Steps 2-3 of `detent-audit tune`: each family's grid from the solve (the legal assignments grouped by the
kernel parameters they launch: assignments that launch the same kernel cost the same, one represents them
all), the workload's heaviest calls, and the oracle that times a candidate on synthetic inputs of each
recorded call's shape (median of repeats), which the tuner core's search (selection/tuner.py) queries."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from detent_audit.engine.llm import LLM
from detent_audit.errors import BadInput
from detent_audit.kernels import AttentionMetadata, AttentionParams, GemmParams, MoeParams
from detent_audit.kernels import attention as attention_ops
from detent_audit.kernels import gemm as gemm_ops
from detent_audit.kernels import moe as moe_ops
from detent_audit.kernels.params import ATTENTION_SPLIT_STRIDE_SPACE, BadParams
from detent_audit.selection.compiler import SolveResult
from detent_audit.selection.tuner import Assignment, FamilyGrid, Workload

REPEATS = 3
# GPU: single timings had heavy tails on the H200 (one in a hundred 10% off, the worst 2x: benchmarks/
# replay_tune.py's data), and one outlier on a heavy call can steer the budgeted search away from the optimum.
# Replayed on both recorded H200 landscapes, the noise of one median of 5 repeats leaves 92-98 of 100 seeds
# within 2% of the optimum, that of a median of 3 such medians 100 of 100: so 15 repeats (RESULTS.md, "Tuner")
GPU_WARMUP, GPU_REPEATS, GPU_LAUNCHES = 3, 15, 10
# distinct calls timed per family: the heaviest (count x work); the rest rarely change the order
MAX_CALLS = 48


# On a GPU the GEMM and MoE kernels take their tile from the shape (no tile changes a row's bits, measured:
# tests/kernels/test_gpu_gemm.py, benchmarks/gpu_moe.py), so the family's pin (a CPU chunk size) launches the
# same kernel whatever its value: a grid of one. The attention's KV tile is bounded by what the Triton kernel
# compiles well at BLOCK_M 64 (larger tiles spill registers); its split stride is any legal multiple of the
# step up to the maximum (the CPU kernel's grid is coarser).
GPU_KV_TILES = (16, 32, 64, 128)
# split strides on the GPU grid: legal multiples of 256 up to 16k, and the short strides a streaming
# deployment commits by default (runtime/kernel_select.py `preferences`)
GPU_STRIDE_STEP, GPU_STRIDE_MAX = 256, 16384
GPU_SHORT_STRIDES = (64, 128)
GPU_SAME_KERNEL = "the tile follows the shape"
# the kernel parameters an assignment launches with (GPU_SAME_KERNEL: a grid of one)
Effective = GemmParams | AttentionParams | str


def _int(a: Mapping[str, Hashable], axis: str) -> int:
    """An integer axis of an assignment (a tile, a stride, a chunk's rows)."""
    value = a[axis]
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadParams(f"{axis} must be an integer, got {value!r}")
    return value


def _str(a: Mapping[str, Hashable], axis: str, default: str) -> str:
    """A string axis of an assignment (a GEMM form), `default` where it is absent."""
    value = a.get(axis, default)
    if not isinstance(value, str):
        raise BadParams(f"{axis} must be a string, got {value!r}")
    return value


def _call(call: Hashable) -> tuple:
    """A recorded call: the tuple of shapes the engine's profile records (tune_record.py)."""
    if not isinstance(call, tuple):
        raise BadInput(f"a recorded call is a tuple of shapes, got {call!r}")
    return call


def _effective(family: str, a: Mapping[str, Hashable], device: str = "cpu") -> Effective | None:
    """The kernel parameters an assignment launches with; None where the kernel's grid (kernels/params.py)
    does not list them (a split stride off the grid is legal for SelIR but not a tuning candidate)."""
    try:
        if family in ("embedded.gemm", "embedded.moe"):
            gemm = GemmParams(_int(a, "chunk_rows"), _str(a, "embedded.gemm.form", "chunk"))
            return GPU_SAME_KERNEL if device != "cpu" else gemm
        if family == "embedded.attention":
            tile = _int(a, "embedded.attention.kv_tile")
            params = AttentionParams(kv_tile=tile, split_stride=_int(a, "tiles_per_split") * tile)
            if device != "cpu":  # the Triton kernel takes any stride that is a whole number of tiles
                stride = params.split_stride
                ok = tile in GPU_KV_TILES and (stride % GPU_STRIDE_STEP == 0 or stride in GPU_SHORT_STRIDES)
                return params if ok and stride <= GPU_STRIDE_MAX else None
            return params if params.split_stride in ATTENTION_SPLIT_STRIDE_SPACE else None
    except (BadParams, KeyError):
        return None
    return None


def _work(family: str, call: tuple) -> float:
    if family == "embedded.attention":
        return float(sum(q * (c + q) for c, q in call[0]) * call[1])
    return float(call[0] * call[1] * (call[2] if family == "embedded.gemm" else call[3]))


def heaviest(family: str, counter: Counter) -> Workload:
    """The MAX_CALLS distinct calls with the most work (count x size), in a fixed order."""
    ranked = sorted(counter.items(), key=lambda kv: (-kv[1] * _work(family, kv[0]), repr(kv[0])))
    return Workload(tuple(ranked[:MAX_CALLS]))


def family_grid(result: SolveResult, current: dict, device: str = "cpu"
                ) -> tuple[FamilyGrid, dict[Assignment, dict]]:
    """The grid over distinct kernel parameters (on `device`), and for each a representative legal
    assignment."""
    reps: dict[Effective, dict] = {}
    for a in result.legal_assignments():
        eff = _effective(result.family, a, device)
        # prefer the assignment whose knob says what its pin does (a pad tuple's knob is what the engine's
        # probe then proves: pin and knob must agree for the tuple to stay legal there)
        if eff is not None and (eff not in reps or (_knob_matches_pin(result.family, a)
                                                    and not _knob_matches_pin(result.family, reps[eff]))):
            reps[eff] = a
    cur = _effective(result.family, current, device)
    if cur is None or cur not in reps:
        raise BadInput(f"{result.family}: the current tuple's kernel parameters {cur} "
                       "are not on the tuning grid",
                       remedy="start from a tuple whose parameters are on the kernel's grid")
    reps[cur] = dict(current)
    axes, rows = _axes(result.family, list(reps))
    grid = FamilyGrid(result.family, axes, tuple(Assignment(r) for r in rows),
                      Assignment(_row(result.family, cur)))
    by_row = {Assignment(_row(result.family, e)): reps[e] for e in reps}
    return grid, by_row


def _knob_matches_pin(family: str, a: dict) -> bool:
    return a.get(f"{family}.chunk_rows") == a.get("chunk_rows")


def _row(family: str, eff: Effective) -> dict:
    if eff == GPU_SAME_KERNEL:
        return {"tile": eff}
    if isinstance(eff, GemmParams):
        return {"chunk_rows": eff.chunk_rows, "form": eff.form}
    if isinstance(eff, AttentionParams):
        return {"kv_tile": eff.kv_tile, "split_stride": eff.split_stride}
    raise BadInput(f"{family}: no tuning axes for kernel parameters {eff!r}")


def _axes(family: str, effs: list[Effective]) -> tuple[dict[str, tuple], list[dict]]:
    rows = sorted((_row(family, e) for e in effs), key=lambda r: tuple(r.values()))
    axes = {k: tuple(sorted({r[k] for r in rows})) for k in rows[0]}
    return axes, rows


@dataclass
class Oracle:
    """Times one family's kernel on synthetic inputs of a recorded call's shape (median of REPEATS); on a GPU,
    the Triton kernel's launches alone (inputs and the step's plan built once, as a CUDA graph holds them),
    timed with device events over GPU_LAUNCHES launches per repeat, replayed from a CUDA graph where the
    engine replays the call's step from one."""

    seed: int = 0
    device: str = "cpu"
    streaming: bool = False  # GPU: the attention's streaming fold (the engine's `attention_streaming`)
    graphs: GraphShape | None = None  # GPU: decode steps replayed from CUDA graphs launch as those do
    # GPU attention: the launches of a repeat read K/V copies that together pass the L2 twice over, as the
    # engine's layers each read their own (one K/V read again and again is served from L2). Off until timed
    # against the warm oracle on the device (benchmarks/gpu_tune.py --cold-kv, RESULTS.md, "Tuner")
    cold_kv: bool = False
    _inputs: dict = field(default_factory=dict, repr=False)  # GPU: each call's synthetic inputs

    def __call__(self, family: str, a: Assignment, call: Hashable) -> float:
        call = _call(call)
        if self.device != "cpu":
            return self._gpu_time(family, a, call)
        run = self._prepare(family, a, call)
        run()  # warm-up
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def _prepare(self, family: str, a: Assignment, call: tuple) -> Callable[[], Any]:
        g = torch.Generator().manual_seed(self.seed)
        if family == "embedded.gemm":
            m, n, k, dtype = call
            x = torch.randn(m, k, generator=g).to(getattr(torch, dtype.split(".")[-1]))
            w = torch.randn(n, k, generator=g).to(x.dtype)
            p = GemmParams(_int(a, "chunk_rows"), _str(a, "form", "chunk"))
            return lambda: gemm_ops.linear(x, w, params=p)
        if family == "embedded.moe":
            m, e, h, i, top_k, renorm, dtype = call
            dt = getattr(torch, dtype.split(".")[-1])
            x = torch.randn(m, h, generator=g).to(dt)
            logits = torch.randn(m, e, generator=g)
            w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(dt)
            w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(dt)
            moe = MoeParams(gemm=GemmParams(chunk_rows=_int(a, "chunk_rows")))
            return lambda: moe_ops.fused_moe(x, logits, w13, w2, top_k, renorm, params=moe)
        seqs, hq, hkv, d, dtype = call
        dt = getattr(torch, dtype.split(".")[-1])
        block = 16
        lens = [c + q for c, q in seqs]
        blocks = [-(-n // block) for n in lens]
        k_cache = torch.randn(sum(blocks) + 1, block, hkv, d, generator=g).to(dt)
        v_cache = torch.randn_like(k_cache)
        tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int64)
        off = 0
        for s, nb in enumerate(blocks):
            tables[s, :nb] = torch.arange(off, off + nb)
            off += nb
        meta = AttentionMetadata.from_lengths([c for c, _ in seqs], [q for _, q in seqs], tables, block)
        q = torch.randn(sum(q for _, q in seqs), hq, d, generator=g).to(dt)
        attn = AttentionParams(kv_tile=_int(a, "kv_tile"), split_stride=_int(a, "split_stride"))
        return lambda: attention_ops.paged_attention(q, k_cache, v_cache, meta, scale=d ** -0.5, params=attn)

    def _gpu_time(self, family: str, a: Assignment, call: tuple) -> float:
        if family != "embedded.attention":
            return 0.0  # a grid of one (GPU_SAME_KERNEL): nothing to compare
        runs = self._prepare_gpu_attention(a, call)
        for _ in range(GPU_WARMUP):  # Triton compiles a new tile on the first; the clocks settle
            runs[0]()
        torch.cuda.synchronize()
        graph = None
        if self.graphs is not None and self.graphs.replays(call):
            # the engine replays this step from a CUDA graph: time the replay, the GPU's work without Python's
            # launch path (eager timing would charge a split's combine launch its host cost, which replay
            # does not pay, and so favour one split)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(GPU_LAUNCHES):
                    runs[i % len(runs)]()
        times = []
        for _ in range(GPU_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if graph is not None:
                graph.replay()
            else:
                for i in range(GPU_LAUNCHES):
                    runs[i % len(runs)]()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / GPU_LAUNCHES)
        return statistics.median(times)

    def _prepare_gpu_attention(self, a: Assignment, call: tuple) -> list[Callable[[], Any]]:
        """The launches to time, in turn: one, or with `cold_kv` one per K/V copy."""
        from detent_audit.kernels.gpu import selected_attention_config
        from detent_audit.kernels.triton_attention import paged_attention, plan_step

        seqs, hq, hkv, d, dtype = call
        if call not in self._inputs:  # a call's inputs serve every candidate
            dt = getattr(torch, dtype.split(".")[-1])
            g = torch.Generator(device=self.device).manual_seed(self.seed)
            block = 16
            blocks = [-(-(c + q) // block) for c, q in seqs]
            k_cache = torch.randn(sum(blocks) + 1, block, hkv, d, generator=g, device=self.device).to(dt)
            tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32, device=self.device)
            off = 0
            for s, nb in enumerate(blocks):
                tables[s, :nb] = torch.arange(off, off + nb, dtype=torch.int32)
                off += nb
            self._inputs[call] = (
                torch.randn(sum(q for _, q in seqs), hq, d, generator=g, device=self.device).to(dt),
                k_cache, torch.randn_like(k_cache), tables,
                torch.tensor([0, *itertools.accumulate(q for _, q in seqs)], dtype=torch.int32,
                             device=self.device),
                torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=self.device))
        q, k_cache, v_cache, tables, cu, ctx = self._inputs[call]
        cfg = selected_attention_config(
            AttentionParams(kv_tile=_int(a, "kv_tile"), split_stride=_int(a, "split_stride")), self.streaming)
        plan = plan_step(cu, ctx, tables, cfg, q.device, hq // hkv)
        if self.graphs is not None and self.graphs.replays(call):  # the graph's splits: the longest context's
            plan = dataclasses.replace(plan, num_splits=-(-self.graphs.max_model_len // cfg.split))
        caches = [(k_cache, v_cache)]
        if self.cold_kv:
            l2 = torch.cuda.get_device_properties(q.device).L2_cache_size
            copies = min(GPU_LAUNCHES, -(-2 * l2 // (k_cache.nbytes + v_cache.nbytes)))
            caches += [(torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(copies - 1)]
        return [functools.partial(paged_attention, q, k, v, cu, ctx, tables, d ** -0.5, cfg, plan=plan)
                for k, v in caches]


@dataclass(frozen=True)
class GraphShape:
    """How the engine's CUDA graphs launch a decode step: batches up to `max_batch`, every decode-only step,
    with the attention splits of `max_model_len` (cuda_graphs.py), whatever the step's own contexts."""

    max_model_len: int
    max_batch: int

    def replays(self, call: tuple) -> bool:
        seqs = call[0]
        return len(seqs) <= self.max_batch and all(q == 1 for _, q in seqs)


def classes_fraction(grid: FamilyGrid, classes: FamilyGrid, fraction: float) -> float:
    """The budget fraction of `classes` (`launch_classes(grid, ...)`) that measures `fraction` of the whole
    `grid`: the budget stays a fraction of the grid the user sees."""
    return min(1.0, fraction * len(grid.legal) / len(classes.legal))


def graph_shape(llm: LLM) -> GraphShape | None:
    """How `llm` replays decode steps (None: it does not)."""
    graphs = llm.runner.graphs
    return GraphShape(graphs.max_model_len, max(graphs.sizes)) if graphs is not None else None


def launch_classes(grid: FamilyGrid, workload: Workload, graphs: GraphShape | None = None) -> FamilyGrid:
    """The grid reduced to one assignment per distinct set of launches on `workload` (GPU attention): a split
    stride at or past a call's longest sequence (for a decode step a CUDA graph replays, the engine's longest
    context) launches that call exactly as no split does, so candidates that differ only there run the same
    kernels on every recorded call and cost the same. Lossless: the representative (the first in grid order,
    the default for its own class) is timed for all of them. The reduced grid's anchors are, per KV tile, the
    class that splits no call, a kernel regime of its own (`FamilyGrid.anchors`)."""
    def longest_of(call: Hashable) -> int:
        if graphs is not None and graphs.replays(_call(call)):
            return graphs.max_model_len
        return max(c + q for c, q in _call(call)[0])

    longest = [longest_of(call) for call, _ in workload.calls]

    def signature(a: Assignment) -> tuple:
        stride = _int(a, "split_stride")
        return (_int(a, "kv_tile"), tuple(None if stride == 0 or stride >= n else stride for n in longest))

    signatures = {a: signature(a) for a in grid.legal}
    reps: dict[tuple, Assignment] = {signatures[grid.default]: grid.default}
    for a in grid.legal:
        reps.setdefault(signatures[a], a)
    legal = tuple(a for a in grid.legal if reps[signatures[a]] == a)
    # the anchors: no partials, no combine pass
    unsplit = tuple(a for a in legal if all(n is None for n in signatures[a][1]))
    return FamilyGrid(grid.family, grid.axes, legal, grid.default, unsplit)
