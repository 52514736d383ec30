"""Tensor parallelism on this CPU: serve at TP=N (ranks as gloo processes, 1 thread each), verify the receipts
at TP=1 by rank emulation and natively at TP=N, count how many a plain TP=1 forward would mismatch, and time
serving at TP=N against TP=1 with N threads on the same requests.

For each `--model:--tp` pair, in this process:
- serve `--requests` mixed requests (greedy and seeded sampling, shared prefixes) offline with receipts;
- verify them by rank emulation (one process, the receipts' own thread count) and natively (`--native`);
- rescore the same (prompt, output) pairs with a plain TP=1 engine: positions whose fp32 logprob bits differ;
- serve the same requests at TP=1 with N threads (`--baseline`): output tokens/s of TP=N over it.

    python benchmarks/tp_cpu.py --model smollm2-135m-instruct:3 --model random:default-20m:2 \
        --model random:default-20m:4 --requests 16 --max-tokens 16 --native --baseline \
        --json benchmarks/results/tp-cpu/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _requests(n: int, max_tokens: int) -> list[dict[str, Any]]:
    lines = []
    for i in range(n):
        prompt = (("You are a careful assistant. Answer briefly. " if i % 2 == 0 else "")
                  + f"Item {i}: describe it.")
        line: dict[str, Any] = {"id": f"r{i}", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        if i % 3:
            line.update(temperature=0.8, top_p=0.95, seed=100 + i)
        lines.append(line)
    return lines


def _serve(config: Any, lines: list[dict[str, Any]], out: Path, key: Any) -> tuple[float, int]:
    from detent_audit.engine.llm import LLM
    from detent_audit.manifests.keys import load_private_key
    from detent_audit.server.node import ServingNode
    from detent_audit.server.offline import serve_offline

    llm = LLM(config)
    try:
        (out / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
        node = ServingNode(llm, load_private_key(key.private_path), out / "run")
        start = time.perf_counter()
        serve_offline(llm, node, out / "in.jsonl", out / "out.jsonl")
        elapsed = time.perf_counter() - start
        node.close()
    finally:
        llm.shutdown()
    tokens = sum(len(json.loads(x)["token_ids"]) for x in (out / "out.jsonl").read_text().splitlines())
    return elapsed, tokens


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _naive_mismatches(model: str, receipts: list[Any]) -> tuple[int, int, int]:
    """What a plain TP=1 engine (1 thread) gives otherwise: positions whose logprob bits differ, of all
    positions, and receipts with any such position."""
    from detent_audit.engine.llm import LLM, EngineConfig

    llm = LLM(EngineConfig(model=model, num_threads=1))
    got = llm.rescore_batch([(list(r.request.prompt_token_ids), list(r.output.token_ids)) for r in receipts])
    differ = total = receipts_differing = 0
    for r, res in zip(receipts, got, strict=True):
        flags = [_bits(a) != _bits(b) for a, b in zip(r.output.logprobs, res.logprobs, strict=True)]
        differ, total = differ + sum(flags), total + len(flags)
        receipts_differing += any(flags)
    return differ, total, receipts_differing


def run(model: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    from detent_audit.engine.llm import EngineConfig
    from detent_audit.manifests.keys import generate_key, load_trusted_keys
    from detent_audit.manifests.receipt import verify_envelope
    from detent_audit.verifier.verify import verify

    lines = _requests(args.requests, args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        key = generate_key(root / "node.key")
        trusted = load_trusted_keys(key.public_path)
        (root / "tp").mkdir()
        serve_s, tokens = _serve(EngineConfig(model=model, tensor_parallel_size=tp, max_num_seqs=32), lines,
                                 root / "tp", key)
        row: dict[str, Any] = {"model": model, "tp": tp, "requests": len(lines), "output_tokens": tokens,
                               "serve_s": round(serve_s, 2), "serve_tok_s": round(tokens / serve_s, 2)}
        start = time.perf_counter()
        report = verify([root / "tp" / "run"], trusted, model=model)
        row["verify_emulated_s"] = round(time.perf_counter() - start, 2)
        row["emulated"] = report.counts()
        if args.native:
            start = time.perf_counter()
            native = verify([root / "tp" / "run"], trusted, model=model, tensor_parallel=tp)
            row["verify_native_s"] = round(time.perf_counter() - start, 2)
            row["native"] = native.counts()
            row["emulated_over_native_per_token"] = round(
                row["verify_emulated_s"] / row["verify_native_s"], 3)
        receipts = [verify_envelope(p.read_bytes(), trusted).receipt
                    for p in sorted((root / "tp" / "run" / "receipts").glob("*.receipt"))]
        differ, total, differing = _naive_mismatches(model, receipts)
        row["naive_tp1_mismatched_positions"] = f"{differ}/{total}"
        row["naive_tp1_receipts_differing"] = f"{differing}/{len(receipts)}"
        if args.baseline:
            (root / "tp1").mkdir()
            base_s, base_tokens = _serve(EngineConfig(model=model, num_threads=tp, max_num_seqs=32), lines,
                                         root / "tp1", key)
            row["tp1_threads"] = tp
            row["tp1_serve_tok_s"] = round(base_tokens / base_s, 2)
            row["tp_over_tp1_tok_s"] = round(row["serve_tok_s"] / row["tp1_serve_tok_s"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="MODEL:TP, repeatable")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--native", action="store_true", help="also verify natively at the receipts' TP")
    parser.add_argument("--baseline", action="store_true", help="also serve at TP=1 with TP threads")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    doc: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": _cores()},
                           "command": "python benchmarks/tp_cpu.py " + " ".join(_argv()), "runs": []}
    for spec in args.model:
        model, _, tp = spec.rpartition(":")
        doc["runs"].append(run(model, int(tp), args))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))  # after every run: nothing lost if a later one fails
        print(json.dumps(doc["runs"][-1]), flush=True)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _argv() -> list[str]:
    return sys.argv[1:]


if __name__ == "__main__":
    main()
