"""Models with weights generated on the device from a seed (`random:<shape>`): deterministic, never zeros,
and served like any checkpoint (CPU here; the GPU battery runs them on the device)."""

from __future__ import annotations

import torch

from detent_audit.engine.generated import generate_model
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.sampling_params import SamplingParams


def test_generated_weights_are_seeded_and_not_zero(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path))
    a = generate_model("random:tiny-llama", torch.float32, "cpu")
    b = generate_model("random:tiny-llama", torch.float32, "cpu")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
        assert pa.abs().sum() > 0
    norms = [p for n, p in a.named_parameters() if "norm" in n]
    assert norms and all(abs(p.mean().item() - 1) < 0.1 for p in norms)


def test_generated_model_serves_and_records_what_it_is(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DETENT_AUDIT_CACHE", str(tmp_path))
    llm = LLM(EngineConfig(model="random:tiny-qwen3"))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    from detent_audit.engine.deployment_facts import collect_facts

    assert collect_facts(llm)["checkpoint"]["generated"] == "random:tiny-qwen3"
