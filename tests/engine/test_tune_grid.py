"""The tuner's GPU grid (no GPU needed: grids and launch classes are pure): the GEMM pin is a grid of one,
attention's grid is the legal (KV tile, split stride) pairs the Triton kernel takes, and candidates that
launch identically on every recorded call collapse to one representative, the default kept."""

from __future__ import annotations

import random

from detent_audit.engine.tune_search import (
    GPU_KV_TILES,
    GPU_SHORT_STRIDES,
    GPU_STRIDE_MAX,
    GPU_STRIDE_STEP,
    family_grid,
    launch_classes,
)
from detent_audit.runtime.kernel_select import engine_deployment, select_kernels
from detent_audit.runtime.model_config import NAMED_SHAPES
from detent_audit.selection.tuner import Workload


def _selection(attention_backend: str = "detent", max_model_len: int = 8320):
    d = engine_deployment(NAMED_SHAPES["llama-3.1-8b"], dtype="bfloat16", num_threads=1, block_size=16,
                          max_model_len=max_model_len, max_num_seqs=32, max_num_batched_tokens=2048,
                          prefix_caching=True, attention_backend=attention_backend)
    return select_kernels("detent", d)


def test_gpu_grids() -> None:
    s = _selection()
    attn, reps = family_grid(s.results["embedded.attention"], s.tuple["embedded.attention"], "cuda")
    assert len(attn.legal) > 100
    for a in attn.legal:
        assert a["kv_tile"] in GPU_KV_TILES
        stride = a["split_stride"]
        assert (stride % GPU_STRIDE_STEP == 0 or stride in GPU_SHORT_STRIDES) and stride <= GPU_STRIDE_MAX
        assert s.results["embedded.attention"].is_legal(reps[a])  # the tuple committed for it is legal
    gemm, _ = family_grid(s.results["embedded.gemm"], s.tuple["embedded.gemm"], "cuda")
    assert len(gemm.legal) == 1


def test_a_streaming_deployment_tunes_from_its_default_tuple() -> None:
    """The streaming GPU kernel's default stride (64 where the split bound allows it) is on the grid, so
    `tune --attention-streaming` starts from the default tuple; so are the shorter strides' neighbours."""
    for length, stride in ((4096, 64), (8192, 128), (8320, 256)):
        s = _selection("detent-streaming", length)
        grid, _ = family_grid(s.results["embedded.attention"], s.tuple["embedded.attention"], "cuda")
        assert grid.default["split_stride"] == stride and grid.default in grid.legal
        assert {a["split_stride"] for a in grid.legal} >= {stride, 256, 512}


def test_launch_classes_merge_exactly_the_identical_launches() -> None:
    s = _selection()
    grid, _ = family_grid(s.results["embedded.attention"], s.tuple["embedded.attention"], "cuda")
    rng = random.Random(5)
    for _ in range(5):
        calls = []
        for _call in range(rng.randint(1, 6)):
            seqs = tuple((rng.randint(0, 6000), rng.choice((1, 1, 64, 2048)))
                         for _ in range(rng.randint(1, 8)))
            calls.append(((seqs, 32, 8, 128, "torch.bfloat16"), rng.randint(1, 50)))
        workload = Workload(tuple(calls))
        longest = max(c + q for call, _ in calls for c, q in call[0])
        reduced = launch_classes(grid, workload)
        assert grid.default in reduced.legal and set(reduced.legal) <= set(grid.legal)
        for tile in GPU_KV_TILES:
            past = [a for a in reduced.legal if a["kv_tile"] == tile and a["split_stride"] >= longest]
            assert len(past) <= 1 + (grid.default["kv_tile"] == tile)  # one class (and the default itself)
            short = {a["split_stride"] for a in grid.legal if a["kv_tile"] == tile
                     and 0 < a["split_stride"] < min(c + q for call, _ in calls for c, q in call[0])}
            kept = {a["split_stride"] for a in reduced.legal if a["kv_tile"] == tile}
            assert short <= kept  # a stride that splits every call is its own class
        # the anchors: per tile, the one class that splits no call (its representative), where one is legal
        unsplit = {a["kv_tile"]: a for a in reduced.legal
                   if all(a["split_stride"] == 0 or a["split_stride"] >= c + q
                          for call, _ in calls for c, q in call[0])}
        assert set(reduced.anchors) == set(unsplit.values())
        assert len({a["kv_tile"] for a in reduced.anchors}) == len(reduced.anchors)


def test_gpu_tuning_searches_launch_classes_within_the_budget(monkeypatch) -> None:
    """tune_engine's GPU path on a CPU engine, with the GPU timer replaced by a cost model whose optimum is
    known: every attention candidate is timed on every call, at most 15% of the grid is measured, the
    exhaustive search's optimum is found, and GEMM is a grid of one."""
    import dataclasses
    import math

    from detent_audit.engine import tune
    from detent_audit.engine.llm import LLM, EngineConfig
    from detent_audit.runtime.sampling_params import SamplingParams

    def cost(self, family, a, call):
        if family != "embedded.attention":
            return 0.0
        total = 0.0
        for c, q in call[0]:
            n = c + q
            splits = -(-n // a["split_stride"]) if a["split_stride"] else 1
            total += n / a["kv_tile"] * (1 + 0.3 * math.log2(a["kv_tile"])) / min(splits, 4) + 3 * splits
        return total * 1e-6

    monkeypatch.setattr(tune.Oracle, "_gpu_time", cost)
    llm = LLM(EngineConfig(model="random:tiny-llama", max_model_len=1024, num_kv_blocks=512))
    # the tuner's GPU path; the engine stays on the CPU
    llm.config = dataclasses.replace(llm.config, device="cuda")
    rng = random.Random(0)
    requests = [(f"r{i}", [rng.randrange(5, 200) for _ in range(rng.randint(10, 600))],
                 SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(12)]
    _, budgeted = tune.tune_engine(llm, requests, mode="budgeted")
    llm.reset()
    _, exhaustive = tune.tune_engine(llm, requests, mode="exhaustive")
    b = {r.family: r for r in budgeted}
    e = {r.family: r for r in exhaustive}
    attention = b["embedded.attention"]
    assert attention.measured <= max(8, int(0.15 * attention.grid_size))
    assert attention.distinct_launches < attention.grid_size
    assert attention.tuned_cost <= e["embedded.attention"].tuned_cost * 1.02
    assert b["embedded.gemm"].grid_size == 1


def test_graph_replayed_decode_steps_split_as_the_graph_does() -> None:
    """A decode step a CUDA graph replays launches the splits of the engine's longest context, so strides
    below it stay distinct even where the step's own sequences are short; prefill calls are unaffected."""
    from detent_audit.engine.tune_search import GraphShape

    s = _selection()
    grid, _ = family_grid(s.results["embedded.attention"], s.tuple["embedded.attention"], "cuda")
    decode_call = (((100, 1), (200, 1)), 32, 8, 128, "torch.bfloat16")
    prefill_call = (((0, 300),), 32, 8, 128, "torch.bfloat16")
    decode, prefill = Workload(((decode_call, 10),)), Workload(((prefill_call, 10),))
    graphs = GraphShape(max_model_len=8320, max_batch=32)
    eager, replayed = launch_classes(grid, decode), launch_classes(grid, decode, graphs)
    assert len(eager.legal) == len(GPU_KV_TILES)  # every stride >= 201: one launch per tile
    assert len(replayed.legal) > 10 * len(GPU_KV_TILES)  # strides below 8320 split the graph's launch
    assert launch_classes(grid, prefill, graphs).legal == launch_classes(grid, prefill).legal
    # a replayed step splits no call only at a stride past the graph's longest context
    assert replayed.anchors and all(a["split_stride"] >= 8320 for a in replayed.anchors)
    assert set(eager.anchors) == set(eager.legal)
    assert graphs.replays(decode.calls[0][0]) and not graphs.replays(prefill.calls[0][0])
