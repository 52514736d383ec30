"""The decode step of the embedded engine on the GPU against its floor and an outside peer, per batch size.

For each mode (detent, stock) and batch size B (default 1, 32, 64, 128, 256): B requests of --prompt tokens
(random ids, seeded; request i has the same prompt at every B) are prefilled, the engine decodes --warmup
steps (capturing the size's graph), then --steps decode steps are timed on the wall clock, each step
including everything the engine does (schedule, lay out, replay, sample, tokens to the host, update). Then
the step's CUDA graph alone is replayed --steps times, timed with CUDA events: host work = wall - replay.
tok/s = B / wall. The floor: (weight bytes + the KV bytes the step reads) / the copy bandwidth measured in
the same run, or the step's matrix FLOPs (2 x weights x B) / the bf16 matrix rate measured there, whichever
is larger (at 256 rows the weights' products are compute-bound). The peer (`peer_decode.py`: a plain Llama
decode step, torch.compile'd, in one CUDA graph, static KV cache) runs the same B at the same context in the
same run.

Bits: each request's outputs (tokens and fp32 logprobs) at every B against the same request at the other
sizes, over the tokens both produced: detent's must be equal; stock's differences are listed.

Usage (device): python3 benchmarks/gpu_decode_loop.py [--shape llama-3.1-8b] [--batches 1,32,64,128,256]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_decode import PeerDecoder, Shape  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (bytes read plus bytes written), median of 20."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * (1 << 30) / sorted(times[5:])[len(times[5:]) // 2]


def matmul_rate() -> float:
    """FLOP/s of a large bf16 matrix product on random data (torch's), median of 20."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = event_ms(lambda: x @ y, 25)
    return 2 * 8192 ** 3 / (ms / 1e3)


def event_ms(fn, reps: int) -> float:
    """Median ms of `fn` over `reps` runs, CUDA events around each."""
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return sorted(out)[len(out) // 2]


def engine_rows(llm: LLM, prompts: list[list[int]], b: int, args: argparse.Namespace, kv_token_bytes: int
                ) -> tuple[dict, list[tuple[list[int], list[float]]]]:
    llm.reset()
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    seqs = [llm.add_request(p, params) for p in prompts[:b]]
    while not (len(llm.scheduler.running) == b and all(s.num_uncomputed_tokens == 1 for s in seqs)):
        llm.step()
    for _ in range(args.warmup):
        llm.step()
    torch.cuda.synchronize()
    context = sum(s.num_tokens for s in seqs)  # KV tokens the first timed step reads
    t0 = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
    graphs = llm.runner.graphs
    replay_ms = None
    if graphs is not None:
        size = graphs.size_for(b)
        replay_ms = event_ms(graphs.graphs[size].replay, args.steps)
    outputs = [(list(s.output_token_ids), list(s.output_logprobs)) for s in seqs]
    profile = None
    if args.profile and b == max(args.batch_list):
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            llm.step()
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
        profile = text.getvalue()
    llm.reset(drop_unfinished=True)
    context += b * args.steps // 2  # mean over the timed steps
    row = {"wall_ms": wall_ms, "replay_ms": replay_ms,
           "host_ms": None if replay_ms is None else wall_ms - replay_ms,
           "tok_s": b / wall_ms * 1e3, "kv_bytes": context * kv_token_bytes, "profile": profile}
    return row, outputs


def compare(outputs: dict[int, list[tuple[list[int], list[float]]]]) -> dict:
    """Each request against itself at every other batch size, over the tokens both produced."""
    sizes = sorted(outputs)
    differ: list[str] = []
    compared = 0
    for i, a in enumerate(sizes):
        for bsz in sizes[i + 1:]:
            for row in range(a):
                (ta, la), (tb, lb) = outputs[a][row], outputs[bsz][row]
                n = min(len(ta), len(tb))
                compared += n
                if ta[:n] != tb[:n] or la[:n] != lb[:n]:
                    differ.append(f"row {row}: b={a} vs b={bsz}")
    return {"tokens_compared": compared, "rows_differing": differ[:40], "num_rows_differing": len(differ)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--modes", default="detent,detent-sync,stock",
                    help="variants: a mode, or detent-sync (detent, no step queued ahead of the last)")
    ap.add_argument("--batches", default="1,32,64,128,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile 10 steps at the largest batch")
    args = ap.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    out_dir = os.environ.get("OUT", ".")
    path = os.path.join(out_dir, f"gpu_decode_loop_{args.shape}.json")
    result: dict = {"device": torch.cuda.get_device_name(), "shape": args.shape, "args": vars(args)}

    def save() -> None:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    bw, rate = copy_bandwidth(), matmul_rate()
    result["copy_bandwidth"], result["matmul_flop_s"] = bw, rate
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    rng = random.Random(0)
    biggest = max(args.batch_list)
    prompts = [[rng.randrange(1, 32000) for _ in range(args.prompt)] for _ in range(biggest)]
    blocks = biggest * (-(-(args.prompt + args.warmup + 2 * args.steps + 40) // 16)) + 64
    shape = None
    every: dict[str, dict[int, list]] = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        engine_mode = mode.removesuffix("-sync")
        llm = LLM(EngineConfig(model=f"random:{args.shape}", device="cuda", dtype="bfloat16",
                               mode=engine_mode, max_num_seqs=biggest,
                               max_num_batched_tokens=max(8192, biggest),
                               num_kv_blocks=blocks, max_model_len=args.max_model_len,
                               attention_streaming=engine_mode != "stock",
                               overlap=not mode.endswith("-sync")))
        c = llm.model.config
        shape = Shape.of(c)
        weight_bytes = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                           if "embed_tokens" not in n or c.tie_word_embeddings)
        kv_token_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
        result.setdefault("weight_bytes", weight_bytes)  # the embedding table is read one row a token
        result.setdefault("weight_bytes_with_embedding",
                          sum(p.numel() * p.element_size() for p in llm.model.parameters()))
        outputs: dict[int, list] = {}
        for b in args.batch_list:
            row, outputs[b] = engine_rows(llm, prompts, b, args, kv_token_bytes)
            row["bytes_floor_ms"] = (weight_bytes + row["kv_bytes"]) / bw * 1e3
            row["flops_floor_ms"] = 2 * weight_bytes / 2 * b / rate * 1e3  # bf16: 2 bytes a weight
            row["floor_ms"] = max(row["bytes_floor_ms"], row["flops_floor_ms"])
            row["floor_ratio_wall"] = row["wall_ms"] / row["floor_ms"]
            result.setdefault(mode, {})[str(b)] = row
            print(f"{mode} b={b}: wall {row['wall_ms']:.3f} ms, replay {row['replay_ms']:.3f} ms, host "
                  f"{row['host_ms']:.3f} ms, {row['tok_s']:.0f} tok/s, floor {row['floor_ms']:.3f} ms "
                  f"({row['floor_ratio_wall']:.2f}x)", flush=True)
            if row["profile"]:
                with open(os.path.join(out_dir, f"profile_{mode}_b{b}.txt"), "w") as f:
                    f.write(row["profile"])
            row.pop("profile")
            save()
        every[mode] = outputs
        result.setdefault("bits", {})[mode] = compare(outputs)
        result.setdefault("build_and_run_s", {})[mode] = time.perf_counter() - t0
        print(f"{mode} bits across sizes: {json.dumps(result['bits'][mode])[:300]}", flush=True)
        save()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if "detent" in every and "detent-sync" in every:  # steps queued ahead change no bit
        same = {str(b): every["detent"][b] == every["detent-sync"][b] for b in args.batch_list}
        result.setdefault("bits", {})["detent_equals_detent_sync"] = same
        print(f"detent (steps queued ahead) equals detent-sync at each B: {same}", flush=True)
        save()
    if not args.no_peer and shape is not None:
        for b in args.batch_list:
            t0 = time.perf_counter()
            max_len = args.prompt + args.warmup + 2 * args.steps + 8
            peer = PeerDecoder(shape, b, max_len)
            peer.capture(args.prompt)
            for _ in range(args.warmup):
                peer.step()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for _ in range(args.steps):
                peer.step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t1) / args.steps * 1e3
            assert peer.graph is not None
            replay_ms = event_ms(peer.graph.replay, args.steps)
            # the static cache is read whole (its mask hides the positions not yet written)
            kv = 2 * shape.layers * b * max_len * shape.kv_heads * shape.head_dim * 2
            floor_ms = max((peer.weight_bytes() + kv) / bw, peer.weight_bytes() * b / rate) * 1e3
            row = {"wall_ms": wall_ms, "replay_ms": replay_ms, "host_ms": wall_ms - replay_ms,
                   "tok_s": b / wall_ms * 1e3, "floor_ms": floor_ms, "floor_ratio_wall": wall_ms / floor_ms,
                   "build_s": time.perf_counter() - t0}
            result.setdefault("peer", {})[str(b)] = row
            print(f"peer b={b}: wall {wall_ms:.3f} ms, replay {replay_ms:.3f} ms, host "
                  f"{wall_ms - replay_ms:.3f} ms, {row['tok_s']:.0f} tok/s, floor {floor_ms:.3f} ms "
                  f"(build {row['build_s']:.0f} s)",
                  flush=True)
            save()
            del peer
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{result['device']}; {args.shape}, bf16, {args.prompt}-token prompts, max_model_len "
          f"{args.max_model_len}, copy bandwidth {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s\n")
    print("| B | who | wall ms/step | replay ms | host ms | tok/s | floor ms | wall / floor |\n"
          "|---|---|---|---|---|---|---|---|")
    for b in args.batch_list:
        for who in (*args.modes.split(","), "peer"):
            r = result.get(who, {}).get(str(b))
            if r:
                host = "-" if r["host_ms"] is None else f"{r['host_ms']:.3f}"
                replay = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.3f}"
                print(f"| {b} | {who} | {r['wall_ms']:.3f} | {replay} | {host} | {r['tok_s']:.0f} | "
                      f"{r['floor_ms']:.3f} | {r['floor_ratio_wall']:.2f} |")
    for mode, bits in result.get("bits", {}).items():
        if mode == "detent_equals_detent_sync":
            continue
        print(f"{mode}: {bits['tokens_compared']} tokens compared across sizes, "
              f"{bits['num_rows_differing']} (row, size pair)s differ")
    save()


if __name__ == "__main__":
    main()
