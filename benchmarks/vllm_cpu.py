"""vLLM CPU figures: the battery per mode and thread count, and output tokens/s of detent over stock.

Each measurement runs in its own process (one vLLM engine per process). Throughput: the same seeded requests
(greedy and seeded sampling, `--requests` prompts of 20-200 tokens, `--max-tokens` each, all submitted
together) served by stock and by detent, the modes interleaved over `--repeats` rounds; the median of each
is reported with the ratio, and detent's verify-by-rescore time per output token (one batched prefill of
every prompt + output) over its serving time per output token, for the rescore verify runs (the output rows
scored in vLLM's model runner) and, beside it in the same engine, through vLLM's prompt logprobs.

    python benchmarks/vllm_cpu.py --model PATH --battery --threads 1,2 --out benchmarks/results/vllm-cpu

The battery's target is `--target-len` tokens (default 600: past the ~256 context tokens where vLLM CPU's
attention changes its KV split) and its prefix cells share whole 32-token vLLM pages; each cell's result
(first differing position, its expected and got logprob bits) is in the JSON, which is rewritten after every
run (`battery-<model>.json` under `--out`).
    python benchmarks/vllm_cpu.py --model PATH --throughput --repeats 3 --out benchmarks/results/vllm-cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _requests(n: int, max_tokens: int) -> list[tuple[list[int], dict]]:
    """Greedy: stock vLLM CPU crashes on a seeded request whose prefill is chunked (`CPU Generator does not
    use offset`, EngineDeadError), so the requests both modes serve are greedy."""
    rng = random.Random(0)
    return [([rng.randrange(0, 256) for _ in range(rng.randint(20, 200))],
             {"temperature": 0.0, "seed": 100 + i, "max_tokens": max_tokens, "ignore_eos": True})
            for i in range(n)]


def child(args: argparse.Namespace) -> dict:
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine
    from detent_audit.runtime.sampling_params import SamplingParams

    t0 = time.perf_counter()
    try:
        engine = VllmEngine(VllmConfig(model=args.model, mode=args.mode, num_threads=args.num_threads))
    except Exception as exc:  # det mode on a CPU: reported, not raised
        return {"mode": args.mode, "threads": args.num_threads, "error": f"{type(exc).__name__}: {exc}"[:400]}
    startup = time.perf_counter() - t0
    if args.job == "battery":
        from detent_audit.bench.battery import prefix_block, run_battery

        t0 = time.perf_counter()
        block = prefix_block(engine)
        def progress(name: str) -> None:
            print(f"cell {name} {time.perf_counter() - t0:.0f}s", flush=True)

        results = run_battery(engine, target_len=args.target_len, block=block, progress=progress)
        return {"mode": args.mode, "threads": args.num_threads, "startup_s": startup,
                "battery_s": time.perf_counter() - t0, "target_len": args.target_len, "prefix_block": block,
                "passed": sum(r.passed for r in results), "total": len(results),
                "failed": [r.name for r in results if not r.passed], "cells": [r.to_json() for r in results]}
    reqs = _requests(args.requests, args.max_tokens)
    params = [SamplingParams(**p) for _, p in reqs]
    engine.generate([reqs[0][0]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    engine.reset()
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params)
    serve_s = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    out = {"mode": args.mode, "threads": args.num_threads, "output_tokens": tokens, "serve_s": serve_s,
           "tokens_per_s": tokens / serve_s}
    if args.mode == "detent":
        # verify-by-rescore, two paths of the same engine interleaved (median of --rescore-repeats): the
        # output rows scored in vLLM's model runner (what verify runs) and vLLM's prompt logprobs (every
        # position)
        greedy = [i for i, (_, p) in enumerate(reqs) if p["temperature"] == 0]
        pairs = [(reqs[i][0], outs[i].token_ids) for i in greedy]
        times: dict[str, list[float]] = {"runner": [], "prompt_logprobs": []}
        equal = True
        for _ in range(args.rescore_repeats):
            for via in times:
                engine.reset()
                t0 = time.perf_counter()
                scored = engine.rescore_batch(pairs, [params[i] for i in greedy], via=via)
                times[via].append(time.perf_counter() - t0)
                equal &= all(s.logprobs == outs[i].logprobs and s.tokens == outs[i].token_ids
                             for s, i in zip(scored, greedy))
        rescored_tokens = sum(len(outs[i].token_ids) for i in greedy)
        rescore_s = statistics.median(times["runner"])
        old_s = statistics.median(times["prompt_logprobs"])
        out.update(rescore_s=rescore_s, rescore_prompt_logprobs_s=old_s, rescore_times=times,
                   rescored_tokens=rescored_tokens,
                   rescore_over_serve=(rescore_s / rescored_tokens) / (serve_s / tokens),
                   rescore_prompt_logprobs_over_serve=(old_s / rescored_tokens) / (serve_s / tokens),
                   rescore_bits_equal=equal)
    return out


def _run_child(args: argparse.Namespace, job: str, mode: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", job, "--model", args.model, "--mode", mode,
           "--num-threads", str(threads), "--requests", str(args.requests), "--max-tokens",
           str(args.max_tokens),
           "--target-len", str(args.target_len), "--rescore-repeats", str(args.rescore_repeats)]
    lines = []
    with tempfile.TemporaryFile("w+") as log, \
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True) as proc:
        for line in proc.stdout:  # progress (a line per battery cell) on stderr as it comes
            if line.startswith("{"):
                lines.append(line)
            elif line.startswith("cell "):
                print(f"  {mode} {threads}t: {line.rstrip()}", file=sys.stderr, flush=True)
        proc.wait()
        log.seek(0)
        err = log.read()
    if not lines:
        return {"mode": mode, "threads": threads, "error": err[-800:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--battery", action="store_true")
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--modes", default="stock,det,detent")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--target-len", type=int, default=600, help="the battery's target prompt, in tokens")
    ap.add_argument("--rescore-repeats", type=int, default=3, help="rescores per path and detent round")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=("battery", "throughput"), default=None)
    ap.add_argument("--mode", default="detent")
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()
    if args.child:
        args.job = args.child
        print(json.dumps(child(args)))
        return
    threads = [int(t) for t in args.threads.split(",")]
    modes = args.modes.split(",")
    report: dict = {"model": args.model}
    if args.battery:
        report["battery"] = []
        for t in threads:
            for mode in modes:
                row = _run_child(args, "battery", mode, t)
                print(json.dumps({k: v for k, v in row.items() if k != "cells"}), flush=True)
                report["battery"].append(row)
                if args.out:  # every finished run kept, whatever happens to the next
                    args.out.mkdir(parents=True, exist_ok=True)
                    path = args.out / f"battery-{Path(args.model).name}.json"
                    path.write_text(json.dumps(report, indent=2) + "\n")
    if args.throughput:
        rounds = []
        for _ in range(args.repeats):  # interleaved: stock, detent, stock, detent, ...
            for mode in ("stock", "detent"):
                row = _run_child(args, "throughput", mode, threads[0])
                print(json.dumps(row), flush=True)
                rounds.append(row)
        med = {m: statistics.median(r["tokens_per_s"] for r in rounds
                                    if r["mode"] == m and "tokens_per_s" in r)
               for m in ("stock", "detent")}
        rescore = [r["rescore_over_serve"] for r in rounds if "rescore_over_serve" in r]
        old = [r["rescore_prompt_logprobs_over_serve"] for r in rounds if "rescore_over_serve" in r]
        cut = [r["rescore_s"] / r["rescore_prompt_logprobs_s"] for r in rounds if "rescore_over_serve" in r]
        report["throughput"] = {"rounds": rounds, "median_tokens_per_s": med,
                                "detent_over_stock": med["detent"] / med["stock"],
                                "rescore_over_serve_median": statistics.median(rescore) if rescore else None,
                                "rescore_prompt_logprobs_over_serve_median":
                                    statistics.median(old) if old else None,
                                "rescore_runner_over_prompt_logprobs_median":
                                    statistics.median(cut) if cut else None}
        print(json.dumps(report["throughput"] | {"rounds": len(rounds)}), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.throughput:
            name = "throughput.json" if not args.battery else "report.json"
            (args.out / name).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
