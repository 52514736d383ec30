"""Property, per shipped deployment and family: the compiled selector of the default tuple is constant over
the whole runtime domain. For any request-only inputs, two runtime points anywhere in the domain (drawn
uniformly and at the edges, powers of two and their neighbours) give the same selection, and the selector
never refuses a point inside the domain."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detent_audit.manifests.deployment import load_deployment, shipped_deployments
from detent_audit.selection.programs import families_for

SHIPPED_PAIRS = [(name, spec.name) for name, path in sorted(shipped_deployments().items())
                 for spec in families_for(load_deployment(path))]


def _values(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for p in range(0, hi.bit_length() + 1) for v in (2 ** p - 1, 2 ** p, 2 ** p + 1)
                    if lo <= v <= hi} | {lo, hi})
    return st.one_of(st.integers(lo, hi), st.sampled_from(edges))


@pytest.mark.parametrize("name, family", SHIPPED_PAIRS)
def test_default_selector_is_constant_over_the_runtime_domain(shipped_solve, name: str, family: str) -> None:
    result, inputs = shipped_solve(name, family)
    assert result.default is not None, f"{name} {family}: no legal default tuple"
    sel = result.selector()
    names = list(inputs)
    runtime = [n for n in names if inputs[n][0] != "Request"]

    point = st.fixed_dictionaries({n: _values(inputs[n][1], inputs[n][2]) for n in names})
    moved = st.fixed_dictionaries({n: _values(inputs[n][1], inputs[n][2]) for n in runtime})

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(point, moved)
    def check(a: dict, b: dict) -> None:
        other = {**a, **b}  # the same request inputs, every runtime input moved
        assert sel(*(a[n] for n in names)) == sel(*(other[n] for n in names)), (a, other)

    check()


@pytest.mark.parametrize("name, family", SHIPPED_PAIRS)
def test_no_shipped_pin_has_one_candidate(shipped_solve, name: str, family: str) -> None:
    result, _ = shipped_solve(name, family)
    assert all(len(p.candidates) > 1 for p in result.pins), result.pins
    assert {p.name for p in result.pins}.isdisjoint(c.name for c in result.constants)
