"""Every shipped deployment's programs, solved once per pytest run (a shared JIT cache)."""

from __future__ import annotations

import pytest

from detent_audit.manifests.deployment import load_deployment, shipped_deployments
from detent_audit.selection.cache import JitCache
from detent_audit.selection.compiler import solve
from detent_audit.selection.frontend import source_of_function
from detent_audit.selection.partial_eval import partial_evaluate
from detent_audit.selection.programs import families_for
from detent_audit.selection.simplify import input_domains


@pytest.fixture(scope="session")
def shipped_solve(tmp_path_factory: pytest.TempPathFactory):
    """shipped_solve(deployment, family) -> (SolveResult, {input: (kind, lo, hi)}), solved once."""
    cache = JitCache(tmp_path_factory.mktemp("jit"))
    done: dict = {}

    def get(name: str, family: str):
        if (name, family) not in done:
            dep = load_deployment(shipped_deployments()[name])
            spec = next(s for s in families_for(dep) if s.name == family)
            facts = spec.facts(dep)
            result = solve(spec.program, facts, family=spec.name, cache=cache)
            prog = partial_evaluate(source_of_function(spec.program), spec.key, facts)
            domains = input_domains(prog)
            inputs = {i.name: (i.kind, int(domains[i.name].lo), int(domains[i.name].hi)) for i in prog.inputs}
            done[name, family] = (result, inputs)
        return done[name, family]

    return get
