"""Solver benchmark, CPU, one process.

1. For every shipped deployment and family: the pins by name with their candidate and legal-value counts, the
   values folded as constants (one candidate), the legal assignments, the pin counts of the two ablations
   (`constant-folding-only`, `no-cut`), and what changed against the previous solver's answer
   (benchmarks/results/solver/selir-1-pins.json). Claims checked: the full analysis never needs more pins
   than either ablation, no pin has one candidate, every family has a legal default.
2. FA3 selection on Llama-3.1-70B-Instruct TP4 H100 (SGLang): cold solve, JIT-cache hit and repin times,
   median of `--repeats` each.

Usage: python benchmarks/solve.py [--repeats 20] [--out FILE]   (prints Markdown; exits 1 if a claim fails)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from detent_audit.manifests.deployment import load_deployment, shipped_deployments
from detent_audit.selection.cache import JitCache
from detent_audit.selection.compiler import SolvedPin, solve
from detent_audit.selection.programs import families_for

FA3_DEPLOYMENT = "llama-3.1-70b-instruct-tp4-h100-sglang"
PREVIOUS = Path(__file__).parent / "results" / "solver" / "selir-1-pins.json"


def _changes(before: dict | None, program: str, pins: Sequence[SolvedPin]) -> str:
    if before is None:
        return "new"
    now = {p.name: len(p.legal_values) for p in pins}
    parts = [] if before["program"] == program else [f"program {before['program']} -> {program}"]
    parts += [f"-{n}({c})" for n, c in before["pins"].items() if n not in now]
    parts += [f"+{n}({c})" for n, c in now.items() if n not in before["pins"]]
    parts += [f"{n} {before['pins'][n]}->{c}" for n, c in now.items()
              if n in before["pins"] and before["pins"][n] != c]
    return ", ".join(parts) or "same"


def table(lines: list[str]) -> bool:
    previous = json.loads(PREVIOUS.read_text())["rows"]
    ok = True
    lines += ["| deployment | family | program | pins: name (candidates / legal) | constants | legal "
              "assignments | "
              "pins, constant-folding-only | pins, no-cut | changed against selir-1 | cold solve |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for name, path in sorted(shipped_deployments().items()):
        dep = load_deployment(path)
        for spec in families_for(dep):
            facts = spec.facts(dep)
            full = solve(spec.program, facts, family=spec.name)
            cf = solve(spec.program, facts, family=spec.name, ablation="constant-folding-only")
            nc = solve(spec.program, facts, family=spec.name, ablation="no-cut")
            if len(full.pins) > min(len(cf.pins), len(nc.pins)) or full.default is None:
                ok = False
            if any(len(p.candidates) < 2 for p in full.pins):
                ok = False
            pins = ", ".join(f"{p.name} ({len(p.candidates)} / {len(p.legal_values)})"
                             for p in full.pins) or "none"
            consts = ", ".join(f"{c.name} = {c.value!r}" for c in full.constants) or "-"
            key = f"{name} {spec.name}"
            seen.add(key)
            lines.append(f"| {name} | {spec.name} | {spec.key} | {len(full.pins)}: {pins} | {consts} | "
                         f"{full.legal_count} | {len(cf.pins)} | {len(nc.pins)} | "
                         f"{_changes(previous.get(key), spec.key, full.pins)} | {full.solve_seconds:.2f} s |")
            print(lines[-1], file=sys.stderr, flush=True)  # progress
    gone = sorted(set(previous) - seen)
    if gone:
        lines.append(f"\nNo longer solved (family gone): {', '.join(gone)}")
    return ok


def timings(lines: list[str], repeats: int) -> bool:
    dep = load_deployment(shipped_deployments()[FA3_DEPLOYMENT])
    spec = next(s for s in families_for(dep) if s.name == "attention")
    facts = spec.facts(dep)
    cold, hit, repin = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            result = solve(spec.program, facts, family=spec.name, cache=JitCache(d))
            cold.append(time.perf_counter() - t0)
            assert result.cache == "miss"
            t0 = time.perf_counter()
            again = solve(spec.program, facts, family=spec.name, cache=JitCache(d))
            selector = again.selector()
            hit.append(time.perf_counter() - t0)
            assert again.cache == "hit"
            pin = again.pins[-1].name
            other = [v for v in again.pins[-1].legal_values if v != selector.pins[pin]][0]
            t0 = time.perf_counter()
            again.repin(selector, **{pin: other})
            repin.append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1000 for k, v in (("cold", cold), ("hit", hit), ("repin", repin))}
    lines += [f"\nFA3 ({spec.key}) on {FA3_DEPLOYMENT}, median of {repeats}, "
              f"{platform.processor() or 'cpu'}, "
              f"{torch.get_num_threads()} threads:\n",
              "| measure | median | bound |\n|---|---|---|",
              f"| cold solve | {med['cold']:.0f} ms | - |",
              f"| cache hit (load + selector) | {med['hit']:.1f} ms | <= 50 ms |",
              f"| repin | {med['repin']:.2f} ms | <= 10 ms |"]
    return med["hit"] <= 50 and med["repin"] <= 10


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    args = parser.parse_args()
    lines: list[str] = []
    ok = table(lines)
    ok = timings(lines, args.repeats) and ok
    lines.append("\nall claims hold" if ok else "\nA CLAIM FAILED")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
