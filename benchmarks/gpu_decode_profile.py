"""Where a decode step's time goes on the GPU: the kernels of one replayed step by total time (the profiler
sees inside the CUDA graph), their sum against the replay's wall time (the rest is the gaps between kernels),
each family's share, each projection's GEMM time in the graph, and for the GEMMs of that step the time of
other tiles at M = B against the floor (every tile gives a row the same bits: tests/kernels/test_gpu_gemm.py
checks it, and so does this script, per tile, against the engine's tile). A tile is timed as the engine runs
it: one launch per layer on that layer's own weights (none left in L2 by the last), captured in a CUDA graph.

Usage (device): python3 benchmarks/gpu_decode_profile.py [--shape llama-3.1-8b] [--batch 1]
Writes $OUT/gpu_decode_profile_<shape>_b<B>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import defaultdict

import torch
import triton.testing

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.kernels.gpu import gemm_tile
from detent_audit.kernels.triton_gemm import TritonGemmConfig, linear
from detent_audit.runtime.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_decode_loop import event_ms  # noqa: E402

PEAK_BW = 4.28e12
PEAK_FLOPS = 790e12
SMALL_TILES = [TritonGemmConfig(16, n, k, 8, w, s) for n in (16, 32, 64, 128) for k in (128, 256)
               for w in (2, 4) for s in (4, 6) if n * k <= 128 * 256]
LARGE_TILES = [TritonGemmConfig(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in (
    (64, 128, 64, 4, 4), (64, 128, 64, 4, 5), (64, 256, 64, 8, 3), (64, 64, 64, 4, 4),
    (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2), (256, 128, 64, 8, 3))]
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's GEMMs in launch order; the LM head last


def family(name: str) -> str:
    lowered = name.lower()
    for key, fam in (("matmul", "gemm"), ("gemm", "gemm"), ("attention", "attention"), ("attn", "attention"),
                     ("rms", "rmsnorm"), ("rope", "rope"), ("silu", "silu"), ("softmax", "sampling"),
                     ("argmax", "sampling"), ("sort", "sampling"), ("copy", "copy"), ("gather", "index"),
                     ("index", "index"), ("scatter", "index")):
        if key in lowered:
            return fam
    return "other"


def chain_ms(fn) -> float:
    """Median ms of `fn` (a layer-by-layer chain of launches) replayed from a CUDA graph."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--no-tiles", action="store_true", help="the profile only, not the GEMM tiles")
    ap.add_argument("--split-stride", type=int, default=None,
                    help="commit this attention split stride (a pinned value: other bits than the default's)")
    args = ap.parse_args()
    committed = (None if args.split_stride is None else
                 {"embedded.attention": {"embedded.attention.split_stride": args.split_stride}})
    b = args.batch
    llm = LLM(EngineConfig(model=f"random:{args.shape}", device="cuda", dtype="bfloat16", mode="detent",
                           max_num_seqs=max(b, 8), max_num_batched_tokens=8192,
                           num_kv_blocks=max(4096, b * (-(-(args.prompt + 80) // 16))),
                           max_model_len=4096, attention_streaming=True, tuple=committed))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(args.prompt)] for _ in range(b)]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    seqs = [llm.add_request(p, greedy) for p in prompts]
    while not all(s.num_output_tokens >= 4 for s in seqs):  # every prefill done, the size's graph captured
        llm.step()
    graphs = llm.runner.graphs
    assert graphs is not None and seqs
    replay = graphs.graphs[graphs.size_for(b)].replay
    torch.cuda.synchronize()
    wall_ms = event_ms(replay, 30)
    reps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    matmuls = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.device_time / 1e3)  # ms
            if ev.name == "_persistent_matmul":
                matmuls.append((ev.time_range.start, ev.device_time / 1e3))
    layers = llm.model.config.num_hidden_layers
    per_step_gemms = 4 * layers + 1
    in_graph: dict[str, float] = defaultdict(float)
    if len(matmuls) == reps * per_step_gemms:  # launch order: each layer's four, then the LM head
        for i, (_, ms) in enumerate(sorted(matmuls)):
            j = i % per_step_gemms
            in_graph[PROJECTIONS[j % 4] if j < 4 * layers else "lm_head"] += ms / reps
    per_step = {k: sum(v) / reps for k, v in kernels.items()}
    calls = {k: len(v) / reps for k, v in kernels.items()}
    total = sum(per_step.values())
    fams: dict[str, float] = defaultdict(float)
    for k, v in per_step.items():
        fams[family(k)] += v
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:20]
    print(f"{args.shape}, batch {b}: replay {wall_ms:.3f} ms, kernels {total:.3f} ms "
          f"({sum(calls.values()):.0f} launches), gaps {wall_ms - total:.3f} ms", flush=True)
    print("families: " + ", ".join(f"{f} {v:.3f}" for f, v in sorted(fams.items(), key=lambda kv: -kv[1])))
    for name, ms in top:
        print(f"  {ms:7.3f} ms  x{calls[name]:4.0f}  {name[:110]}")
    print("GEMMs in the graph, per step: " + ", ".join(f"{k} {v:.3f} ms" for k, v in in_graph.items()))
    # the step's GEMMs at M = b under other tiles
    c = llm.model.config
    h, kvd = c.hidden_size, c.num_key_value_heads * c.head_dim
    qd = c.num_attention_heads * c.head_dim
    shapes = {"qkv": (h, qd + 2 * kvd), "o": (qd, h),
              "gate_up": (h, 2 * c.intermediate_size), "down": (c.intermediate_size, h),
              "lm_head": (h, c.vocab_size)}
    gemms = {}
    tiles = SMALL_TILES if b <= 16 else LARGE_TILES
    for label, (k, n) in ({} if args.no_tiles else shapes).items():
        copies = 1 if label == "lm_head" else layers
        x = torch.randn(b, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        engine_tile = gemm_tile(b, n, k)
        ref = linear(x, ws[0], config=engine_tile)
        floor = max(n * k * 2 / PEAK_BW, 2 * b * n * k / PEAK_FLOPS) * 1e3
        rows = {}
        for tile in [engine_tile, *[t for t in tiles if t != engine_tile]]:
            try:
                y = linear(x, ws[0], config=tile)
                ms = chain_ms(lambda tile=tile, x=x, ws=ws: [linear(x, w, config=tile) for w in ws]) / copies
            except Exception as exc:  # a tile Triton cannot build (shared memory)
                rows[repr(tile)] = {"error": type(exc).__name__}
                continue
            rows[repr(tile)] = {"ms": ms, "floor_ratio": ms / floor, "same_bits": bool(torch.equal(y, ref))}
        ok = {t: r for t, r in rows.items() if "ms" in r}
        best = min(ok, key=lambda t: ok[t]["ms"])
        cublas = chain_ms(lambda x=x, ws=ws: [torch.nn.functional.linear(x, w) for w in ws]) / copies
        gemms[label] = {"floor_ms": floor, "engine_tile": repr(engine_tile),
                        "in_graph_ms": in_graph.get(label), "engine": rows[repr(engine_tile)],
                        "best_tile": best, "best": ok[best], "cublas_ms": cublas,
                        "all_same_bits": all(r["same_bits"] for r in ok.values()), "tiles": rows}
        print(f"{label} {k}->{n}: floor {floor:.4f} ms, engine {rows[repr(engine_tile)]['ms']:.4f} "
              f"({rows[repr(engine_tile)]['floor_ratio']:.2f}x), best {ok[best]['ms']:.4f} "
              f"({ok[best]['floor_ratio']:.2f}x) {best}, cuBLAS {cublas:.4f}, every tile same bits: "
              f"{gemms[label]['all_same_bits']}", flush=True)
        for t, r in sorted(ok.items(), key=lambda tr: tr[1]["ms"])[:6]:
            print(f"    {r['ms']:.4f} ms ({r['floor_ratio']:.2f}x) bits {r['same_bits']} {t}")
    out = {"device": torch.cuda.get_device_name(), "shape": args.shape, "batch": b, "replay_ms": wall_ms,
           "kernel_ms": total, "families_ms": fams, "top": top, "gemms_in_graph_ms": in_graph, "gemms": gemms}
    path = os.path.join(os.environ.get("OUT", "."), f"gpu_decode_profile_{args.shape}_b{b}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
