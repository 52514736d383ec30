"""`detent-audit tune`: commit a tuple for a workload (DESIGN section 3, "Tuner").

1. Serve the profiling workload with the current tuple and record every kernel call per family: gemm
   (M, N, K), attention (each sequence's context and query length, heads, head dim), moe (M, experts,
   sizes) with their counts.
2. Build each family's grid from the solve: the legal assignments, grouped by the kernel parameters they
   produce (assignments that launch the same kernel cost the same; one represents them all).
3. Search each grid with the tuner core (budgeted or exhaustive) against an oracle that times the family's
   kernel on synthetic inputs of each recorded call's shape (median of repeats).
4. Commit the best assignment of each family: a tuple file the engine, `serve` and `verify` accept.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from detent_audit.engine.llm import LLM
from detent_audit.errors import BadInput
from detent_audit.kernels import AttentionMetadata, AttentionParams, GemmParams, KernelSet, MoeParams
from detent_audit.kernels import attention as attention_ops
from detent_audit.kernels import gemm as gemm_ops
from detent_audit.kernels import moe as moe_ops
from detent_audit.kernels.params import ATTENTION_SPLIT_STRIDE_SPACE, BadParams
from detent_audit.selection.compiler import SolveResult
from detent_audit.selection.tuner import Assignment, FamilyGrid, TuneResult, Workload, search

REPEATS = 3
MAX_CALLS = 48  # distinct calls timed per family: the heaviest (count x work); the rest rarely change the order


class RecordingKernels:
    """Delegates to a KernelSet and counts each family's calls by shape."""

    def __init__(self, inner: KernelSet) -> None:
        self.inner = inner
        self.calls: dict[str, Counter] = {"embedded.gemm": Counter(), "embedded.attention": Counter(),
                                          "embedded.moe": Counter()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def linear(self, x, weight, bias=None):
        self.calls["embedded.gemm"][(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1], str(x.dtype))] += 1
        return self.inner.linear(x, weight, bias)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
        seqs = tuple(zip(meta.context_lens.tolist(), q_lens))
        self.calls["embedded.attention"][(seqs, q.shape[1], k_cache.shape[2], q.shape[2], str(q.dtype))] += 1
        return self.inner.attention(q, k_cache, v_cache, meta, scale)

    def moe(self, x, router_logits, w13, w2, top_k, renormalize):
        self.calls["embedded.moe"][(x.shape[0], w13.shape[0], w13.shape[2], w2.shape[2], top_k, renormalize,
                                    str(x.dtype))] += 1
        return self.inner.moe(x, router_logits, w13, w2, top_k, renormalize)


def record_calls(llm: LLM, requests: Iterable[tuple[str, list[int], Any]]) -> dict[str, Counter]:
    """Serve `requests` (all submitted together) and return each family's recorded calls."""
    recorder = RecordingKernels(llm.runner.kernels)
    llm.runner.kernels = recorder
    try:
        seqs = [llm.add_request(ids, params, rid) for rid, ids, params in requests]
        llm.run(seqs)
    finally:
        llm.runner.kernels = recorder.inner
    return {f: c for f, c in recorder.calls.items() if c}


def _effective(family: str, a: dict) -> Hashable | None:
    """The kernel parameters an assignment launches with; None where the kernel's grid (kernels/params.py)
    does not list them (a split stride off the grid is legal for SelIR but not a tuning candidate)."""
    try:
        if family in ("embedded.gemm", "embedded.moe"):
            return GemmParams(chunk_rows=a["chunk_rows"])
        if family == "embedded.attention":
            tile = a["embedded.attention.kv_tile"]
            params = AttentionParams(kv_tile=tile, split_stride=a["tiles_per_split"] * tile)
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


def family_grid(result: SolveResult, current: dict) -> tuple[FamilyGrid, dict[Hashable, dict]]:
    """The grid over distinct kernel parameters, and for each a representative legal assignment."""
    reps: dict[Hashable, dict] = {}
    for a in result.legal_assignments():
        eff = _effective(result.family, a)
        if eff is not None and eff not in reps:
            reps[eff] = a
    cur = _effective(result.family, current)
    if cur is None or cur not in reps:
        raise BadInput(f"{result.family}: the current tuple's kernel parameters {cur} are not on the tuning grid",
                       remedy="start from a tuple whose parameters are on the kernel's grid")
    reps[cur] = dict(current)
    axes, rows = _axes(result.family, list(reps))
    grid = FamilyGrid(result.family, axes, tuple(Assignment(r) for r in rows), Assignment(_row(result.family, cur)))
    by_row = {Assignment(_row(result.family, e)): reps[e] for e in reps}
    return grid, by_row


def _row(family: str, eff: Any) -> dict:
    if isinstance(eff, GemmParams):
        return {"chunk_rows": eff.chunk_rows}
    return {"kv_tile": eff.kv_tile, "split_stride": eff.split_stride}


def _axes(family: str, effs: list) -> tuple[dict[str, tuple], list[dict]]:
    rows = sorted((_row(family, e) for e in effs), key=lambda r: tuple(r.values()))
    axes = {k: tuple(sorted({r[k] for r in rows})) for k in rows[0]}
    return axes, rows


@dataclass
class Oracle:
    """Times one family's kernel on synthetic inputs of a recorded call's shape (median of REPEATS)."""

    seed: int = 0

    def __call__(self, family: str, a: Assignment, call: tuple) -> float:
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
            p = GemmParams(chunk_rows=a["chunk_rows"])
            return lambda: gemm_ops.linear(x, w, params=p)
        if family == "embedded.moe":
            m, e, h, i, top_k, renorm, dtype = call
            dt = getattr(torch, dtype.split(".")[-1])
            x = torch.randn(m, h, generator=g).to(dt)
            logits = torch.randn(m, e, generator=g)
            w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(dt)
            w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(dt)
            p = MoeParams(gemm=GemmParams(chunk_rows=a["chunk_rows"]))
            return lambda: moe_ops.fused_moe(x, logits, w13, w2, top_k, renorm, params=p)
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
        p = AttentionParams(kv_tile=a["kv_tile"], split_stride=a["split_stride"])
        return lambda: attention_ops.paged_attention(q, k_cache, v_cache, meta, scale=d ** -0.5, params=p)


@dataclass(frozen=True)
class FamilyReport:
    family: str
    grid_size: int
    measured: int
    default_cost: float
    tuned_cost: float
    chosen: dict

    def to_json(self) -> dict:
        return dict(self.__dict__)


def tune_engine(llm: LLM, requests: list, *, mode: str = "budgeted", budget_fraction: float = 0.15,
                seed: int = 0, progress: Callable[[str, int, int], None] | None = None
                ) -> tuple[dict[str, dict], list[FamilyReport]]:
    """Profile `requests` on `llm` (detent mode), tune every called family, return (tuple, reports)."""
    if llm.config.mode != "detent":
        raise BadInput("tune commits a tuple for detent mode", remedy="use --mode detent")
    calls = record_calls(llm, requests)
    oracle = Oracle(seed)
    committed = dict(llm.selection.tuple)
    reports = []
    for family, counter in sorted(calls.items()):
        grid, reps = family_grid(llm.selection.results[family], committed[family])
        workload = heaviest(family, counter)
        result: TuneResult = search(grid, workload, lambda a, c, f=family: oracle(f, a, c), mode=mode,
                                    budget_fraction=budget_fraction, seed=seed,
                                    progress=(lambda m, lim, f=family: progress(f, m, lim)) if progress else None)
        default_cost = next(m.cost for m in result.trace if m.assignment == grid.default and m.complete)
        committed[family] = reps[result.best]
        reports.append(FamilyReport(family, result.grid_size, result.measured, default_cost, result.cost,
                                    dict(result.best)))
    return committed, reports
