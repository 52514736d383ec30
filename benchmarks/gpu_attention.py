"""GPU paged attention on the device: bit invariance across prefill / chunked prefill / decode /
batch composition, accuracy against fp32, and speed against torch SDPA.

A token's output must have the same bits whether its sequence is prefilled whole, in chunks, decoded one
token at a time with the context cached, or run beside other sequences. Writes $OUT/gpu_attention.json.
Usage (device): python3 benchmarks/gpu_attention.py [--baseline FILE]
  --baseline: another version of kernels/triton_attention.py (e.g. `git show REV:kernels/triton_attention.py`)
  timed in the same run on the same inputs, as ratios of this version over it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F
import triton.testing
from kernel_module import load_kernel, load_kernel_file

ta = load_kernel("triton_attention")
H, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16


class Cache:
    """Random K/V of each sequence written into shuffled pages."""

    def __init__(self, lens: list[int], seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        pages = [-(-n // PAGE) for n in lens]
        perm = torch.randperm(sum(pages) + 4, device="cuda", generator=g)
        self.k = torch.randn(sum(pages) + 4, PAGE, HKV, D, device="cuda", dtype=DT, generator=g)
        self.v = torch.randn_like(self.k)
        self.tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
        self.kv = []
        off = 0
        for i, (n, p) in enumerate(zip(lens, pages)):
            self.tables[i, :p] = perm[off:off + p].to(torch.int32)
            off += p
            idx = self.tables[i, :p].long()
            self.kv.append((self.k[idx].reshape(-1, HKV, D)[:n], self.v[idx].reshape(-1, HKV, D)[:n]))
        self.q = [torch.randn(n, H, D, device="cuda", dtype=DT, generator=g) for n in lens]

    def run(self, seqs: list[int], starts: list[int], ends: list[int], cfg) -> list[torch.Tensor]:
        """Query rows [start, end) of each listed sequence in one launch; returns each one's [n, H, D]."""
        q = torch.cat([self.q[s][a:b] for s, a, b in zip(seqs, starts, ends)])
        cu = torch.tensor([0] + list(torch.tensor([b - a for a, b in zip(starts, ends)]).cumsum(0)),
                          dtype=torch.int32, device="cuda")
        out = ta.paged_attention(q, self.k, self.v, cu,
                                 torch.tensor(starts, dtype=torch.int32, device="cuda"),
                                 self.tables[seqs], D ** -0.5, cfg)
        return list(out.split([b - a for a, b in zip(starts, ends)]))

    def reference(self, s: int) -> torch.Tensor:
        k, v = self.kv[s]
        q = self.q[s].float().transpose(0, 1)
        kk = k.float().repeat_interleave(H // HKV, 1).transpose(0, 1)
        vv = v.float().repeat_interleave(H // HKV, 1).transpose(0, 1)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True).transpose(0, 1)


def invariance(cfg, lens: list[int]) -> dict:
    c = Cache(lens, seed=1)
    n = len(lens)
    whole_alone = [c.run([s], [0], [lens[s]], cfg)[0] for s in range(n)]
    whole_batch = c.run(list(range(n)), [0] * n, lens, cfg)
    chunks = []
    for s in range(n):
        parts, a = [], 0
        while a < lens[s]:
            b = min(lens[s], a + 37)
            parts.append(c.run([s], [a], [b], cfg)[0])
            a = b
        chunks.append(torch.cat(parts))
    decode = [torch.cat([c.run([s], [p], [p + 1], cfg)[0] for p in range(max(0, lens[s] - 3), lens[s])])
              for s in range(n)]
    mixed = c.run(list(range(n)), [lens[s] - 1 if s % 2 else 0 for s in range(n)], lens,
                  cfg)  # decode + prefill
    res = {"batch==alone": all(torch.equal(whole_batch[s], whole_alone[s]) for s in range(n)),
           "chunked==alone": all(torch.equal(chunks[s], whole_alone[s]) for s in range(n)),
           "decode==prefill": all(torch.equal(decode[s],
                                              whole_alone[s][-decode[s].shape[0]:]) for s in range(n)),
           "mixed batch==alone": all(torch.equal(mixed[s],
                                                 whole_alone[s][-mixed[s].shape[0]:]) for s in range(n))}
    errs = [((whole_alone[s].float() - c.reference(s)).norm() / c.reference(s).norm()).item()
            for s in range(n)]
    res["max rel err vs fp32"] = max(errs)
    return res


def _launch_only(c: Cache, seqs: list[int], starts: list[int], ends: list[int], cfg, mod=ta):
    """A callable that runs only the kernels (inputs and the step's plan built once, as the engine's CUDA
    graphs hold them), so small decode batches time the GPU, not the host."""
    q = torch.cat([c.q[s][a:b] for s, a, b in zip(seqs, starts, ends)])
    sizes = [b - a for a, b in zip(starts, ends)]
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(starts, dtype=torch.int32, device="cuda")
    tables = c.tables[seqs]
    plan = mod.plan_step(cu, ctx, tables, cfg, q.device, H // HKV)
    return lambda: mod.paged_attention(q, c.k, c.v, cu, ctx, tables, D ** -0.5, cfg, plan=plan)


def _graph_bench(fn) -> float:
    """Median ms of `fn` replayed from a CUDA graph, as the engine replays decode steps: a decode launch of a
    few microseconds times the GPU, not Python's launch path."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def timings(cfg, mod=ta) -> dict:
    """Decode launches timed replayed from CUDA graphs (as the engine runs them), prefill eagerly."""
    out = {}
    for b, n in ((64, 4096), (1, 512), (1, 1024), (1, 8192), (8, 4096)):  # decode: one query each
        lens = [n] * b
        c = Cache(lens, seed=2)
        ours = _graph_bench(_launch_only(c, list(range(b)), [x - 1 for x in lens], lens, cfg, mod))
        kk = torch.stack([c.kv[s][0] for s in range(b)]).transpose(1, 2)  # [B, HKV, L, D] contiguous copies
        vv = torch.stack([c.kv[s][1] for s in range(b)]).transpose(1, 2)
        qq = torch.stack([c.q[s][-1:] for s in range(b)]).transpose(1, 2)  # [B, H, 1, D]
        sdpa = _graph_bench(functools.partial(F.scaled_dot_product_attention, qq, kk, vv, enable_gqa=True))
        out[f"decode {b}x{n}"] = {"ours_ms": ours, "sdpa_contiguous_ms": sdpa,
                                  "floor_ms": 2 * b * n * HKV * D * 2 / 4.28e12 * 1e3}
    for b, n in ((4, 4096), (1, 8192)):  # prefill: whole sequences
        lens = [n] * b
        c = Cache(lens, seed=3)
        ours = triton.testing.do_bench(_launch_only(c, list(range(b)), [0] * b, lens, cfg, mod), warmup=25,
                                       rep=50, return_mode="median")
        qq = torch.stack(c.q).transpose(1, 2)
        kk = torch.stack([c.kv[s][0] for s in range(b)]).transpose(1, 2)
        vv = torch.stack([c.kv[s][1] for s in range(b)]).transpose(1, 2)
        sdpa = triton.testing.do_bench(lambda qq=qq, kk=kk, vv=vv: F.scaled_dot_product_attention(
            qq, kk, vv, is_causal=True, enable_gqa=True), warmup=25, rep=50, return_mode="median")
        flops = 4 * b * n * n * H * D / 2
        out[f"prefill {b}x{n}"] = {"ours_ms": ours, "sdpa_contiguous_ms": sdpa,
                                   "floor_ms": flops / 790e12 * 1e3}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None, help="another triton_attention.py to time beside this one")
    ap.add_argument("--configs", default=None, help="comma-separated subset of the configs (default: all)")
    ap.add_argument("--one-pass", action="store_true",
                    help="time each streaming config's in-program fold both ways: "
                                                            "a loop per split as '<name>', one pass "
                                                            "(FOLD_IN_ONE_PASS, "
                                                            "the default) as '<name>+1pass'")
    args = ap.parse_args()
    torch.manual_seed(0)
    configs = {"m64n64s2048": ta.TritonAttentionConfig(64, 64, 2048, 4, 2),
               "m64n64s2048w8": ta.TritonAttentionConfig(64, 64, 2048, 8, 2),
               "m64n32s2048": ta.TritonAttentionConfig(64, 32, 2048, 4, 2),
               "m64n64s512": ta.TritonAttentionConfig(64, 64, 512, 4, 2),
               "m128n64s2048w8": ta.TritonAttentionConfig(128, 64, 2048, 8, 2),
               "m128n64s2048w8s3": ta.TritonAttentionConfig(128, 64, 2048, 8, 3),
               # streaming mode (splits folded in one program for prefill): small strides for decode
               "stream-m64n64s2048": ta.TritonAttentionConfig(64, 64, 2048, 4, 2, streaming=True),
               "stream-m64n64s512": ta.TritonAttentionConfig(64, 64, 512, 4, 2, streaming=True),
               "stream-m64n64s256": ta.TritonAttentionConfig(64, 64, 256, 4, 2, streaming=True),
               "stream-m64n32s512": ta.TritonAttentionConfig(64, 32, 512, 4, 2, streaming=True),
               "stream-m64n64s512w8": ta.TritonAttentionConfig(64, 64, 512, 8, 2, streaming=True),
               # the committed tuple's values (KV tile 64, stride 4096) and launch shapes for decode: a
               # decode launch fills G = 4 of BLOCK_M's rows, so BLOCK_M 16 does a quarter of the work
               "stream-m64n64s4096": ta.TritonAttentionConfig(64, 64, 4096, 4, 2, streaming=True),
               "stream-m64n64s4096st3": ta.TritonAttentionConfig(64, 64, 4096, 4, 3, streaming=True),
               "stream-m64n64s4096st1": ta.TritonAttentionConfig(64, 64, 4096, 4, 1, streaming=True),
               "stream-m64n64s4096w8": ta.TritonAttentionConfig(64, 64, 4096, 8, 2, streaming=True),
               "stream-m16n64s4096w1": ta.TritonAttentionConfig(16, 64, 4096, 1, 2, streaming=True),
               "stream-m16n64s4096w1st3": ta.TritonAttentionConfig(16, 64, 4096, 1, 3, streaming=True),
               "stream-m16n64s4096w2": ta.TritonAttentionConfig(16, 64, 4096, 2, 2, streaming=True),
               "stream-m16n64s4096w4": ta.TritonAttentionConfig(16, 64, 4096, 4, 2, streaming=True)}
    if args.configs:
        unknown = set(args.configs.split(",")) - set(configs)
        if unknown:
            raise SystemExit(f"unknown configs {sorted(unknown)}; known: {', '.join(configs)}")
        configs = {n: c for n, c in configs.items() if n in args.configs.split(",")}
    results = {"device": torch.cuda.get_device_name(), "invariance": {}, "timing": {}, "baseline": {}}
    one_pass_default = ta.FOLD_IN_ONE_PASS
    if args.one_pass:
        ta.FOLD_IN_ONE_PASS = False  # '<name>' is the loop per split, '<name>+1pass' the one-pass fold
    for name, cfg in configs.items():
        results["invariance"][name] = invariance(cfg, [1, 17, 150, 700, 2500])
        results["timing"][name] = timings(cfg)
        print(name, json.dumps(results["invariance"][name]), flush=True)
        if args.one_pass and cfg.streaming:
            ta.FOLD_IN_ONE_PASS = True
            results["invariance"][name + "+1pass"] = invariance(cfg, [1, 17, 150, 700, 2500])
            results["timing"][name + "+1pass"] = timings(cfg)
            ta.FOLD_IN_ONE_PASS = False
            print(name + "+1pass", json.dumps(results["invariance"][name + "+1pass"]), flush=True)
    if args.baseline:
        base = load_kernel_file(args.baseline, "baseline_attention")
        for name in [n for n in ("m64n64s2048", "m64n32s2048", "m128n64s2048w8",
                                 "stream-m64n64s512") if n in configs]:
            fields = {f: getattr(configs[name], f) for f in configs[name].__dataclass_fields__}
            results["baseline"][name] = timings(base.TritonAttentionConfig(**fields), base)
    # tile sensitivity: the same tokens through every config (same split stride) -> same bits?
    lens = [1, 17, 150, 700, 2500]
    c = Cache(lens, seed=1)
    outs = {name: c.run(list(range(len(lens))), [0] * len(lens), lens, cfg) for name, cfg in configs.items()}
    if args.one_pass:  # the one-pass fold must give its loop-per-split config's bits
        ta.FOLD_IN_ONE_PASS = True
        outs.update({name + "+1pass": c.run(list(range(len(lens))), [0] * len(lens), lens, cfg)
                     for name, cfg in configs.items() if cfg.streaming})
        ta.FOLD_IN_ONE_PASS = one_pass_default
        results["one_pass_bits_equal"] = {name: all(torch.equal(a, b) for a, b in zip(outs[name + "+1pass"],
                                                                                      outs[name]))
                                          for name, cfg in configs.items() if cfg.streaming}
        print("one pass == loop per split:", results["one_pass_bits_equal"], flush=True)
    first = next(iter(outs))
    results["tiles"] = {name: all(torch.equal(a, b) for a, b in zip(o,
                                                                    outs[first])) for name, o in outs.items()}
    print(f"same bits as {first}:", results["tiles"], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_attention.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\ndevice: {results['device']}; H={H}, HKV={HKV}, D={D}, page {PAGE}, bf16\n")
    print("| config | batch==alone | chunked==alone | decode==prefill | mixed==alone | rel err |")
    print("|---|---|---|---|---|---|")
    for name, r in results["invariance"].items():
        print(f"| {name} | {r['batch==alone']} | {r['chunked==alone']} | {r['decode==prefill']} | "
              f"{r['mixed batch==alone']} | {r['max rel err vs fp32']:.1e} |")
    print("\n| config | workload | ours ms | SDPA (contiguous KV) ms | ratio | floor ms | baseline ms "
          "| ours / baseline |\n|---|---|---|---|---|---|---|---|")
    for name, rows in results["timing"].items():
        for w, r in rows.items():
            base = results["baseline"].get(name, {}).get(w)
            vs = f"{base['ours_ms']:.3f} | {r['ours_ms'] / base['ours_ms']:.2f}" if base else "- | -"
            print(f"| {name} | {w} | {r['ours_ms']:.3f} | {r['sdpa_contiguous_ms']:.3f} | "
                  f"{r['ours_ms'] / r['sdpa_contiguous_ms']:.2f} | {r['floor_ms']:.3f} | {vs} |")


if __name__ == "__main__":
    main()
