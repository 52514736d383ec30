"""The invariance battery on CPU: 35 cells x {Llama, Qwen3, Qwen3-MoE} x {fp32, bf16} x {detent, stock,
det}, on seeded random checkpoints of the named tiny shapes (and the embedded default model).

Prints a Markdown table: passing cells per mode and, for stock and det, the failing cells.
Usage: python benchmarks/battery_cpu.py [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from detent_audit.bench.battery import run_battery
from detent_audit.engine.checkpoint import ensure_default_model, write_random_checkpoint
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.model_config import ModelConfig

SHAPES = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ok = True
    print("| model | dtype | detent | det | stock | stock's failing cells |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        models = {s: write_random_checkpoint(Path(d) / s, ModelConfig.from_name(s), seed=11) for s in SHAPES}
        models["default-20m"] = ensure_default_model()
        for name, path in models.items():
            for dtype in ("float32", "bfloat16"):
                row = {}
                for mode in ("detent", "det", "stock"):
                    llm = LLM(EngineConfig(model=str(path), mode=mode, dtype=dtype, max_num_seqs=40,
                                           max_num_batched_tokens=256, num_kv_blocks=2048))
                    row[mode] = run_battery(llm, seed=args.seed)
                passed = {m: sum(r.passed for r in res) for m, res in row.items()}
                ok = ok and passed["detent"] == 35
                failing = ", ".join(r.name for r in row["stock"] if not r.passed) or "none"
                print(f"| {name} | {dtype} | {passed['detent']}/35 | {passed['det']}/35 | "
                      f"{passed['stock']}/35 | "
                      f"{failing} |", flush=True)
    print("\ndetent passes 35/35 everywhere:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
