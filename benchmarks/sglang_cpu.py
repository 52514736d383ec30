"""SGLang on this CPU, stock and detent (the plugin through its entry point): the 35-cell battery per mode,
then output tokens/s of the same requests, the modes interleaved, median of repeats.

    python benchmarks/sglang_cpu.py --json benchmarks/results/sglang-cpu/battery_and_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from detent_audit.bench.battery import run_battery
from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine
from detent_audit.runtime.named_models import resolve_model
from detent_audit.runtime.sampling_params import SamplingParams


def _speed(engine: SglangEngine, prompts: list[list[int]], tokens: int) -> float:
    engine.reset()
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--skip-battery", action="store_true")
    ap.add_argument("--modes", default="detent,stock", help="the modes run (tokens/s needs both)")
    ap.add_argument("--kv-tokens", type=int, default=32768,
                    help="each engine's KV pool in tokens (its memory; the battery needs the default)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    resolve_model(args.model)  # a wheel model is imported before any timing
    started = time.perf_counter()
    report = {"machine": f"{_cpu_name()} ({platform.machine()}), {os.cpu_count()} cores, {args.threads} "
                         "thread(s) used",
              "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "model": args.model,
              "workload": f"{args.batch} greedy requests of 16-64 random byte tokens, {args.tokens} output "
                          "tokens each, "
                          "submitted together", "kv_tokens": args.kv_tokens, "modes": {}}
    engines = {}
    modes = [m for m in ("detent", "stock") if m in args.modes.split(",")]
    for mode in modes:
        t = time.perf_counter()
        engines[mode] = SglangEngine(SglangConfig(model=args.model, mode=mode, num_threads=args.threads,
                                                    max_total_tokens=args.kv_tokens))
        report["modes"][mode] = {"start_s": round(time.perf_counter() - t, 1),
                                 "start_profile": engines[mode].start_profile}
        if not args.skip_battery:
            t = time.perf_counter()
            cells = run_battery(engines[mode],
                                progress=lambda name, m=mode: print(m, name, file=sys.stderr, flush=True))
            report["modes"][mode].update(
                battery_s=round(time.perf_counter() - t, 1), passed=sum(c.passed for c in cells),
                cells=[c.to_json() for c in cells], failing=[c.name for c in cells if not c.passed])
            print(mode, report["modes"][mode]["passed"], "/", len(cells), "failing:",
                  report["modes"][mode]["failing"], file=sys.stderr, flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(16, 64))] for _ in range(args.batch)]
    if len(engines) < 2:
        args.repeats = 0  # one mode: its battery only
    rates: dict[str, list[float]] = {m: [] for m in engines}
    report["load_average_per_round"] = []
    for _ in range(args.repeats):
        for mode, engine in engines.items():  # interleaved: both modes see the same machine load
            rates[mode].append(_speed(engine, prompts, args.tokens))
            print(mode, "tokens/s", round(rates[mode][-1], 2), file=sys.stderr, flush=True)
        report["load_average_per_round"].append([round(x, 2) for x in os.getloadavg()])
    if args.repeats:
        pairs = zip(rates["detent"], rates["stock"], strict=True)
        report["detent_over_stock_per_round"] = [round(d / s, 3) for d, s in pairs]
    for mode in engines if args.repeats else ():
        report["modes"][mode]["tokens_per_s"] = [round(r, 2) for r in rates[mode]]
        report["modes"][mode]["tokens_per_s_median"] = round(statistics.median(rates[mode]), 2)
    if args.repeats:
        report["detent_over_stock"] = round(report["modes"]["detent"]["tokens_per_s_median"]
                                            / report["modes"]["stock"]["tokens_per_s_median"], 3)
    report["total_s"] = round(time.perf_counter() - started, 1)
    for engine in engines.values():
        engine.shutdown()
    text = json.dumps(report, indent=1, sort_keys=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
