"""Verification speed: `verify --mode rescore` against serving, per output token.

Serves N requests offline on the random-20m model (signing a receipt for each) at each serving
concurrency asked for, then verifies the receipts with `rescore` (one teacher-forced prefill per request,
batched), in 1 and W processes, and optionally with `replay`; one run, CPU.

Batch invariance makes every serving concurrency produce the same receipts' outputs (checked here, bit for
bit), so one rescore stands against every serving run. The time each spends in the pinned GEMM (the tuple's
16-row chunks) is recorded too: a rescore cannot take less than its own GEMM time with the tuple's kernel, so
serving time over that GEMM time bounds the speed-up any rescore could reach on this core.

Usage: python benchmarks/verify.py [--requests 256] [--output-tokens 64] [--concurrency all|C[,C...]]
                                   [--workers W] [--replay] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import detent_audit.kernels.gemm as gemm
from detent_audit.bench.workloads import parse_concurrencies
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import serve_offline
from detent_audit.verifier.verify import verify


@contextmanager
def gemm_clock():
    """Seconds spent in the pinned chunked GEMM while the block runs (this process only)."""
    spent = [0.0]
    inner = gemm._chunked_matmul

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    gemm._chunked_matmul = timed
    try:
        yield spent
    finally:
        gemm._chunked_matmul = inner


def label(c: int | None) -> str:
    return "all at once" if c is None else f"concurrency {c}"


def outputs_of(path: Path) -> list[tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["id"], r.get("token_ids"), r.get("logprobs"), r.get("receipt_id") is not None) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--replay", action="store_true", help="also time --mode replay")
    ap.add_argument("--concurrency", default="all",
                    help="serving as a closed loop of C clients, or 'all' submitted at once; a comma list "
                         "serves once per entry (default: all)")
    ap.add_argument("--workers", type=int, default=1, help="verify --workers: processes that re-execute")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    concurrencies = parse_concurrencies(args.concurrency)
    rng = random.Random(0)
    tokens = args.requests * args.output_tokens
    serving: list[dict] = []
    timings: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        key = generate_key(root / "node.key")
        lines = [{"id": f"r{i}",
                  "prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(16, 128))],
                  "max_tokens": args.output_tokens, "temperature": rng.choice([0.0, 0.8]), "top_p": 0.95,
                  "seed": i, "ignore_eos": True} for i in range(args.requests)]
        (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
        first_outputs = None
        for c in concurrencies:
            tag = "all" if c is None else str(c)
            llm = LLM(EngineConfig(model="random-20m", mode="detent"))
            node = ServingNode(llm, load_private_key(key.private_path), root / f"receipts-{tag}")
            with gemm_clock() as gemm_s:
                t0 = time.perf_counter()
                serve_offline(llm, node, root / "in.jsonl", root / f"out-{tag}.jsonl", max_in_flight=c)
                node.close()
                serve_s = time.perf_counter() - t0
            del llm
            outputs = outputs_of(root / f"out-{tag}.jsonl")
            first_outputs = first_outputs or outputs
            same = outputs == first_outputs
            serving.append({"concurrency": c, "seconds": serve_s, "gemm_seconds": gemm_s[0],
                            "outputs_equal_first": same})
            print(f"served {label(c)}: {serve_s:.1f} s (GEMM {gemm_s[0]:.1f} s); outputs bit-equal to the "
                  f"first run's: {same}", file=sys.stderr)
            if not same:
                print("FAIL: serving concurrency changed an output", file=sys.stderr)
                return 2
        receipts = root / f"receipts-{'all' if concurrencies[0] is None else concurrencies[0]}"
        trusted = load_trusted_keys(key.public_path)
        runs = [("rescore", 1)] + [("rescore",
                                    args.workers)] * (args.workers > 1) + [("replay", 1)] * args.replay
        for mode, workers in runs:
            with gemm_clock() as gemm_s:
                t0 = time.perf_counter()
                report = verify([receipts], trusted, mode=mode, workers=workers)
                seconds = time.perf_counter() - t0
            name = mode if workers == 1 else f"{mode} --workers {workers}"
            timings[name] = {"seconds": seconds, "workers": workers,
                             "gemm_seconds": gemm_s[0] if workers == 1 else None}
            assert report.exit_code == 0, report.counts()
            print(f"verify --mode {name}: {seconds:.1f} s", file=sys.stderr)
    rescore_gemm = timings["rescore"]["gemm_seconds"]
    print(f"device: {platform.processor() or platform.machine()} "
          f"({torch.backends.cpu.get_cpu_capability()}), 1 thread per engine, torch {torch.__version__}; "
          f"{os.cpu_count()} cores; default-20m fp32; {args.requests} requests, prompts 16-128 tokens, "
          f"{args.output_tokens} output tokens each; one run\n")
    print("| serving | serve (generate + sign) | of it GEMM | per output token | "
          + " | ".join(f"verify --mode {m}" for m in timings) + " | bound: serve / rescore's GEMM |")
    print("|---" * (5 + len(timings)) + "|")
    for s in serving:
        cells = " | ".join(f"{t['seconds']:.1f} s = **{s['seconds'] / t['seconds']:.2f}x**"
                           for t in timings.values())
        print(f"| {label(s['concurrency'])} | {s['seconds']:.1f} s | {s['gemm_seconds']:.1f} s | "
              f"{s['seconds'] / tokens * 1e3:.2f} ms | {cells} | {s['seconds'] / rescore_gemm:.2f}x per "
              "worker |")
    print(f"\nrescore's own GEMM time (1 worker): {rescore_gemm:.1f} s of "
          f"{timings['rescore']['seconds']:.1f} s")
    best = min(t["seconds"] for m, t in timings.items() if m.startswith("rescore"))
    verdicts = {label(s["concurrency"]): s["seconds"] / best >= 5 for s in serving}
    for name, ok in verdicts.items():
        print(f"rescore at least 5x faster than serving {name}: {'yes' if ok else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"requests": args.requests, "output_tokens": args.output_tokens,
                                         "cores": os.cpu_count(), "torch": torch.__version__,
                                         "serving": serving, "verify": timings}, indent=2))
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
