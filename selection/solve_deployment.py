"""Solve every selection program a deployment runs (what `detent-audit solve` prints)."""

from __future__ import annotations

from pathlib import Path

from detent_audit.errors import BadInput
from detent_audit.manifests.deployment import load_deployment
from detent_audit.selection.cache import JitCache
from detent_audit.selection.compiler import SolveResult, solve
from detent_audit.selection.programs import families_for


def solve_deployment(path: str | Path, *, families: list[str] | None = None, ablation: str | None = None,
                     cache_dir: str | Path | None = None, use_cache: bool = True) -> list[SolveResult]:
    """One SolveResult per family the deployment runs (optionally only `families`), in family order."""
    dep = load_deployment(path)
    specs = families_for(dep)
    if families:
        known = [s.name for s in specs]
        unknown = sorted(set(families) - set(known))
        if unknown:
            raise BadInput(f"{Path(path).name}: no family {unknown} in this deployment",
                           remedy=f"choose among {', '.join(known)}")
        specs = [s for s in specs if s.name in families]
    cache = JitCache(cache_dir) if use_cache else None
    return [solve(spec.program, spec.facts(dep), ablation=ablation, cache=cache, family=spec.name)
            for spec in specs]
