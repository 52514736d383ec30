"""The method's own figures against the project's, on the main deployments, CPU, one process.

For Llama-3.1-70B-Instruct TP4 and Qwen3-30B-A3B TP4, each in vLLM and SGLang (manifests/deployments/), with
the solver's own ablation switches (`detent-audit solve --ablate ...`, selection/compiler.py ABLATIONS):

1. pins of attention + all-reduce + MoE (the full analysis);
2. FA3's pins with constant folding alone (`constant-folding-only`);
3. the MoE's pins without a cut (`no-cut`: every batch-dependent selection point pinned);
4. FA3's candidate assignments without the analysis (`no-cut`: the product of every batch-dependent point's
   candidates and the knobs) and with it;
5. the candidate assignments judged per deployment (every family's candidate product, full analysis) and the
   cold solve time (no cache);
6. repin time (swap one pin of a compiled selector, checked legal), median of `--repeats`;
7. the MoE tuner's space if the tuned table's row key were pinned instead of M (the distinct row keys times
   the M-switches' values, from the program run as plain Python over every M).

Usage: python benchmarks/solver_method.py [--repeats 50] [--json FILE]   (prints one JSON document)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from detent_audit.manifests.deployment import load_deployment, shipped_deployments
from detent_audit.selection.compiler import solve
from detent_audit.selection.programs import families_for, fused_moe

MAIN = ("llama-3.1-70b-instruct-tp4-h100-vllm", "llama-3.1-70b-instruct-tp4-h100-sglang",
        "qwen3-30b-a3b-tp4-h100-vllm", "qwen3-30b-a3b-tp4-h100-sglang")
FAMILIES = ("attention", "all_reduce", "moe")


def moe_row_key_space(dep) -> dict:
    """The tuner's MoE space if the row key and each M-switch were pinned apart (the method's cut)."""
    facts = fused_moe.facts(dep)
    keys, naive, combine = set(), set(), set()
    for m in range(1, dep.engine.max_num_batched_tokens + 1):
        c = fused_moe.fused_moe(facts, m)
        keys.add(min(facts.table_keys, key=lambda k: (abs(k - m), k)) if facts.has_table else None)
        naive.add(c.block_assignment)
        combine.add(c.combine)
    return {"row_keys": len(keys), "block_assignment": len(naive), "combine": len(combine),
            "pins": 1 + (len(naive) > 1) + (len(combine) > 1),
            "assignments": len(keys) * len(naive) * len(combine)}


def one(name: str, repeats: int) -> dict:
    dep = load_deployment(shipped_deployments()[name])
    specs = {s.name: s for s in families_for(dep)}
    out: dict = {"deployment": name, "families": {}}
    judged, cold = 0, 0.0
    for family, spec in specs.items():
        facts = spec.facts(dep)
        t0 = time.perf_counter()
        full = solve(spec.program, facts, family=family)
        cold += time.perf_counter() - t0
        judged += full.candidate_count
        row = {"program": full.program, "pins": [p.name for p in full.pins],
               "candidates_per_pin": {p.name: len(p.candidates) for p in full.pins},
               "legal_per_pin": {p.name: len(p.legal_values) for p in full.pins},
               "knobs": {k.name: len(k.choices) for k in full.knobs},
               "candidate_assignments": full.candidate_count, "legal_assignments": full.legal_count,
               "exhaustive": full.exhaustive, "cold_solve_s": round(full.solve_seconds, 3)}
        if family in ("attention", "moe"):
            for ablation in ("constant-folding-only", "no-cut"):
                r = solve(spec.program, facts, family=family, ablation=ablation)
                row[ablation] = {"pins": [p.name for p in r.pins], "candidate_assignments": r.candidate_count,
                                 "legal_assignments": r.legal_count}
        if family == "moe":
            row["row_key_cut"] = moe_row_key_space(dep)
        out["families"][family] = row
    out["pins"] = {f: len(out["families"][f]["pins"]) if f in out["families"] else 0 for f in FAMILIES}
    out["candidate_assignments_judged"] = judged
    out["cold_solve_s"] = round(cold, 3)
    # repin: swap the attention selector's first pin between two legal values
    spec = specs["attention"]
    result = solve(spec.program, spec.facts(dep), family="attention")
    selector = result.selector()
    pin = result.pins[0]
    values = [v for v in pin.legal_values if v != result.default[pin.name]][:1] + [result.default[pin.name]]
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        selector = result.repin(selector, **{pin.name: values[i % len(values)]})
        times.append(time.perf_counter() - t0)
    out["repin_ms_median"] = round(statistics.median(times) * 1000, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None, help="also write the document here")
    args = ap.parse_args(argv)
    doc = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "processor": platform.processor() or platform.machine()},
           "deployments": [one(name, args.repeats) for name in MAIN]}
    text = json.dumps(doc, indent=1, sort_keys=True)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
