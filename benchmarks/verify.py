"""Verification speed (issue 4 acceptance): `verify --mode rescore` against serving, per output token.

Serves N requests offline on the embedded default model (signing a receipt for each), then verifies the
receipts with `rescore` (one teacher-forced prefill per request, batched) and with `replay`; one run, CPU.
Usage: python benchmarks/verify.py [--requests 256] [--output-tokens 64] [--concurrency C] [--workers W]
`--workers W` also times rescore in W processes, each an engine of the deployment's one thread (the serving
engine's), in the same run.
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
from pathlib import Path

import torch

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import serve_offline
from detent_audit.verifier.verify import verify


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--replay", action="store_true", help="also time --mode replay")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="serve as a closed loop of this many clients (default: all requests at once)")
    ap.add_argument("--workers", type=int, default=1, help="verify --workers: processes that re-execute")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        key = generate_key(root / "node.key")
        lines = [{"id": f"r{i}", "prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(16, 128))],
                  "max_tokens": args.output_tokens, "temperature": rng.choice([0.0, 0.8]), "top_p": 0.95,
                  "seed": i, "ignore_eos": True} for i in range(args.requests)]
        (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
        llm = LLM(EngineConfig(mode="detent"))
        node = ServingNode(llm, load_private_key(key.private_path), root / "out")
        t0 = time.perf_counter()
        serve_offline(llm, node, root / "in.jsonl", root / "out.jsonl", max_in_flight=args.concurrency)
        node.close()
        serve_s = time.perf_counter() - t0
        del llm
        tokens = args.requests * args.output_tokens
        trusted = load_trusted_keys(key.public_path)
        timings = {}
        runs = [("rescore", 1)] + [("rescore", args.workers)] * (args.workers > 1) + [("replay", 1)] * args.replay
        for mode, workers in runs:
            t0 = time.perf_counter()
            report = verify([root / "out"], trusted, mode=mode, workers=workers)
            timings[mode if workers == 1 else f"{mode} --workers {workers}"] = time.perf_counter() - t0
            assert report.exit_code == 0, report.counts()
    print(f"device: {platform.processor() or platform.machine()} "
          f"({torch.backends.cpu.get_cpu_capability()}), 1 thread, torch {torch.__version__}; "
          f"default-20m fp32; {args.requests} requests, prompts 16-128 tokens, {args.output_tokens} output tokens "
          f"each; served {'all at once' if not args.concurrency else f'at concurrency {args.concurrency}'}; "
          f"{os.cpu_count()} cores; one run\n")
    print("| step | wall | per output token | speed-up over serving |\n|---|---|---|---|")
    print(f"| serve (generate + sign) | {serve_s:.1f} s | {serve_s / tokens * 1e3:.2f} ms | 1.00 |")
    for mode, s in timings.items():
        print(f"| verify --mode {mode} (incl. engine start) | {s:.1f} s | {s / tokens * 1e3:.2f} ms | "
              f"{serve_s / s:.2f} |")
    ok = serve_s / min(t for m, t in timings.items() if m.startswith("rescore")) >= 5
    print(f"\nrescore at least 5x faster than serving: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
