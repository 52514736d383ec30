"""Every shipped deployment states its engine version's defaults, as upstream's own config reads them, and
the facts a file leaves out default to upstream's values; SGLang's FA3 build is the one `fa3_sglang`
transcribes."""

from __future__ import annotations

import dataclasses

import pytest

from detent_audit.manifests.deployment import EngineFacts, load_deployment, shipped_deployments
from detent_audit.manifests.engine_defaults import ENGINE_DEFAULTS, departures, upstream_defaults
from detent_audit.selection.errors import NotTranscribed
from detent_audit.selection.programs import fa3

SHIPPED = {name: load_deployment(path) for name, path in shipped_deployments().items()}
HOSTED = {name: d for name, d in SHIPPED.items() if d.engine.name in ("vllm", "sglang")}


@pytest.mark.parametrize("name", sorted(HOSTED))
def test_hosted_deployment_states_its_engine_version_defaults(name: str) -> None:
    d = HOSTED[name]
    assert upstream_defaults(d), f"{d.engine.name} {d.engine.version}: no upstream defaults recorded"
    assert departures(d) == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_omitted_fact_takes_the_upstream_default(engine: str) -> None:
    field_defaults = {f.name: f.default for f in dataclasses.fields(EngineFacts)}
    recorded = [(version, d) for (e, version), ds in ENGINE_DEFAULTS.items() if e == engine for d in ds]
    assert recorded
    for version, d in recorded:
        if d.fact == "fa3_source":   # no build is assumed: an SGLang file must name it
            assert field_defaults[d.fact] == ""
        else:
            assert field_defaults[d.fact] == d.value, (version, d.source)


def test_vllm_cascade_default_is_upstreams() -> None:
    d = SHIPPED["llama-3.1-8b-instruct-tp1-h100-vllm"]
    assert d.engine.disable_cascade_attn is True and not fa3.facts(d).cascade_enabled
    opted_in = dataclasses.replace(d, engine=dataclasses.replace(d.engine, disable_cascade_attn=False))
    assert departures(opted_in) and "disable_cascade_attn" in departures(opted_in)[0]


def test_sglang_fa3_build_is_the_transcribed_commit() -> None:
    recorded = {d.value for ds in ENGINE_DEFAULTS.values() for d in ds if d.fact == "fa3_source"}
    assert recorded == {fa3.SGLANG_FA3_SOURCE}
    assert fa3.SGLANG_FA3_SOURCE.endswith("@f20a52329482ddca4a627b2f028f88c2959ee299")
    d = SHIPPED["llama-3.1-70b-instruct-tp4-h100-sglang"]
    assert fa3.facts(d).head_dim == 128
    older = dataclasses.replace(d, engine=dataclasses.replace(
        d.engine, fa3_source="sgl-project/sgl-attn@39da714b0000000000000000000000000000000"))
    with pytest.raises(NotTranscribed, match="fa3_source"):
        fa3.facts(older)
