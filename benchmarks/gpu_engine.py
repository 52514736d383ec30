"""The embedded engine on the GPU: the invariance battery and speed figures on the device.

A named shape (Llama-3.2-1B, Llama-3.1-8B, Qwen3-30B-A3B) with weights generated on the GPU from a seed, bf16,
CUDA graphs for decode (--eager: none). For detent, det and stock: the 35-cell battery; output tokens/s on a
closed batch; the decode step at batch 1 against the HBM floor (weight bytes / 4.28 TB/s; for a MoE also the
floor of the weights a batch-1 step reads, its top_k experts of each block); rescoring against
generating. `--model` runs a checkpoint folder (or model name) instead of a generated shape.
Usage (device): python3 benchmarks/gpu_engine.py [--shape llama-3.1-8b | --model DIR] [--tuple FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from detent_audit.bench.battery import run_battery
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.tuples import load_tuple


def active_weight_bytes(llm: LLM) -> int:
    """The weight bytes a batch-1 decode step reads: every parameter, except that of each MoE block's experts
    only top_k of num_experts are read (the floor `weight bytes / 4.28 TB/s` counts them all)."""
    total = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    for block in llm.model.modules():
        experts = getattr(block, "experts", None)
        if experts is not None and hasattr(block, "top_k"):
            size = sum(p.numel() * p.element_size() for p in experts.parameters())
            total -= size - size * block.top_k // experts.num_experts
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--model", default=None,
                    help="a checkpoint folder or model name (default: random:<shape>)")
    ap.add_argument("--modes", default="detent,stock,det")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--tuple", default=None,
                    help="detent's committed tuple (JSON/msgpack); default: the preferred")
    ap.add_argument("--battery-modes", default=None, help="modes that run the battery (default: all)")
    ap.add_argument("--no-graph-check", action="store_true", help="skip the graph-against-eager comparison")
    ap.add_argument("--attention-streaming", action="store_true",
                    help="det/detent: the attention's streaming fold")
    ap.add_argument("--max-num-seqs", type=int, default=40, help="the engine's seats (graphs up to them)")
    args = ap.parse_args()
    committed = load_tuple(args.tuple) if args.tuple else None
    battery_modes = (args.battery_modes or args.modes).split(",")
    model = args.model or f"random:{args.shape}"
    label = os.path.basename(os.path.normpath(args.model)) if args.model else args.shape
    out: dict = {"device": torch.cuda.get_device_name(), "shape": label, "modes": {}}
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 400))] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for mode in args.modes.split(","):
        llm = LLM(EngineConfig(model=model, device="cuda", dtype="bfloat16", mode=mode,
                               max_num_seqs=args.max_num_seqs, num_kv_blocks=4096, max_model_len=4096,
                               max_num_batched_tokens=max(1024, args.max_num_seqs),
                               cuda_graphs=not args.eager,
                               tuple=committed if mode == "detent" else None,
                               attention_streaming=args.attention_streaming and mode != "stock"))
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
        active_bytes = active_weight_bytes(llm)
        t0 = time.perf_counter()
        cells = run_battery(llm, seed=0) if mode in battery_modes else []
        battery_s = time.perf_counter() - t0
        # closed batch: 32 requests x 64 tokens
        llm.reset()
        llm.generate(prompts[:4], params)  # warm-up (Triton compilation)
        llm.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        gen_s = time.perf_counter() - t0
        tps = 32 * 64 / gen_s
        # rescoring the same outputs (what `verify --mode rescore` re-executes), one prefill each, batched
        llm.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        scores = llm.rescore_batch([(o.prompt_token_ids, o.token_ids) for o in outs])
        torch.cuda.synchronize()
        rescore_s = time.perf_counter() - t0
        same = all(s.logprobs == o.logprobs for s, o in zip(scores, outs))
        # decode step at batch 1: time per output token of one request after its prefill
        llm.reset()
        one = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
        seq = llm.add_request(prompts[0], one)
        llm.step()  # prefill
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while llm.has_unfinished():
            llm.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / (seq.num_output_tokens - 1) * 1e3
        out["modes"][mode] = {
            "battery_passed": sum(c.passed for c in cells) if cells else None, "tuple": llm.selection.tuple,
                              "failing": [c.name for c in cells if not c.passed],
            "battery_s": battery_s, "output_tok_s": tps, "decode_step_ms_b1": step_ms,
            "rescore_speedup": gen_s / rescore_s, "rescore_bits_equal": same,
            "hbm_floor_ms": weight_bytes / 4.28e12 * 1e3, "hbm_floor_active_ms": active_bytes / 4.28e12 * 1e3}
        print(mode, json.dumps(out["modes"][mode]), flush=True)
        # graph replay against the eager step, bit for bit
        if mode == "detent" and not args.eager and not args.no_graph_check:
            llm.reset()
            mixed = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=24, ignore_eos=True)
                     for i in range(12)]
            graphed = llm.generate(prompts[:12], mixed)
            eager_llm = LLM(EngineConfig(model=model, device="cuda", dtype="bfloat16", mode=mode,
                                         max_num_seqs=args.max_num_seqs, num_kv_blocks=4096,
                                         max_num_batched_tokens=max(1024, args.max_num_seqs),
                                         max_model_len=4096, cuda_graphs=False, tuple=committed,
                                         attention_streaming=args.attention_streaming))
            eager = eager_llm.generate(prompts[:12], mixed)
            del eager_llm  # its weights and KV pool go before the next mode's engine is built
            out["modes"][mode]["graph==eager"] = all(
                a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(graphed, eager))
            print("graph == eager:", out["modes"][mode]["graph==eager"], flush=True)
        del llm
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), f"gpu_engine_{label}.json"), "w") as f:
        json.dump(out, f, indent=1)
    decode = "eager" if args.eager else "CUDA graphs for decode"
    print(f"\ndevice: {out['device']}; {label}, bf16, {decode}\n")
    print("| mode | battery | output tok/s (32x64) | ratio | decode step b=1 | HBM floor | active-weight "
          "floor | "
          "rescore speed-up |\n|---|---|---|---|---|---|---|---|")
    base = out["modes"].get("stock", {}).get("output_tok_s")
    for mode, r in out["modes"].items():
        ratio = f"{r['output_tok_s'] / base:.2f}" if base else "-"
        print(f"| {mode} | {r['battery_passed'] if r['battery_passed'] is not None else '-'}/35 | "
              f"{r['output_tok_s']:.0f} | {ratio} | "
              f"{r['decode_step_ms_b1']:.2f} ms | {r['hbm_floor_ms']:.3f} ms | "
              f"{r['hbm_floor_active_ms']:.3f} ms | "
              f"{r['rescore_speedup']:.1f}x "
              f"(bits {'equal' if r['rescore_bits_equal'] else 'DIFFER'}) |")
    for mode, r in out["modes"].items():
        if r["failing"]:
            print(f"{mode} fails: {', '.join(r['failing'])}")


if __name__ == "__main__":
    main()
