"""Rank emulation on one GPU: a TP=N forward of the Llama-3.1-8B shape (random weights, bf16) with every
rank's shard computed in this process and the partials added in rank order, emulated twice (two engines built
apart): bits equal; against a plain TP=1 forward: bits differ; time per emulated step over a TP=1 step.

    python benchmarks/gpu_tp_emulation.py --json OUT.json [--shape llama-3.1-8b] [--tp 2,4] [--batch 1,32]

Eager steps (no CUDA graphs for tensor-parallel models yet), the same seeded requests for every variant.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch


def _engine(shape: str, tp: int) -> Any:
    from detent_audit.engine.llm import LLM, EngineConfig

    return LLM(EngineConfig(model=f"random:{shape}", device="cuda", dtype="bfloat16", cuda_graphs=False,
                            tensor_parallel_size=tp, tensor_parallel_ranks="emulated", max_num_seqs=64,
                            num_kv_blocks=4096))


def _run(llm: Any, batch: int, tokens: int) -> tuple[list[list[float]], float]:
    """`batch` seeded requests of a 128-token prompt, each decoding `tokens` tokens -> logprobs and ms
    per decode step."""
    from detent_audit.runtime.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 32000, (128,), generator=gen).tolist() for _ in range(batch)]
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=tokens, ignore_eos=True)
              for i in range(batch)]
    llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)] * batch)  # warm-up
    llm.reset()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return [o.logprobs for o in outs], 1000 * elapsed / tokens


def _bits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).view(torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    sizes, batches = [int(x) for x in args.tp.split(",")], [int(x) for x in args.batch.split(",")]
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "shape": args.shape,
                           "tokens": args.tokens, "runs": []}
    results: dict[tuple[int, int, int], tuple[list[list[float]], float]] = {}
    for tp in [1, *sizes]:
        for build in (0, 1) if tp > 1 else (0,):  # each TP emulated twice, by engines built apart
            llm = _engine(args.shape, tp)
            for batch in batches:
                results[(tp, build, batch)] = _run(llm, batch, args.tokens)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    for tp in sizes:
        for batch in batches:
            first, again, plain = results[(tp, 0, batch)], results[(tp, 1, batch)], results[(1, 0, batch)]
            doc["runs"].append({
                "tp": tp, "batch": batch,
                "emulated_twice_bits_equal": bool(torch.equal(_bits(first[0]), _bits(again[0]))),
                "tp1_positions_differing": int((_bits(first[0]) != _bits(plain[0])).sum()),
                "positions": len(first[0]) * len(first[0][0]),
                "emulated_step_ms": round(min(first[1], again[1]), 3), "tp1_step_ms": round(plain[1], 3),
                "emulated_over_tp1": round(min(first[1], again[1]) / plain[1], 3)})
            print(json.dumps(doc["runs"][-1]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
