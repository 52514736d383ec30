"""The engine contract: the embedded engine implements it, its facts name it, and verify refuses (not
comparable, exit 3) a receipt whose facts name an engine it cannot rebuild, before loading any model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.keys import generate_key, load_private_key, load_trusted_keys
from detent_audit.manifests.receipt import sign_receipt, verify_envelope
from detent_audit.runtime.contract import EMBEDDED, Engine
from detent_audit.runtime.registry import facts_name
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import serve_offline
from detent_audit.verifier.reconstruct import NotComparable, reconstruct

runner = CliRunner()


@pytest.fixture(scope="module")
def llm(make_checkpoint, tmp_path_factory) -> LLM:
    return LLM(EngineConfig(model=str(make_checkpoint("tiny-llama")),
                            cache_dir=str(tmp_path_factory.mktemp("jit"))))


def test_embedded_engine_implements_the_contract(llm: LLM) -> None:
    assert isinstance(llm, Engine)
    assert llm.facts()["engine"]["name"] == EMBEDDED == facts_name(llm.facts())
    assert llm.max_model_len == llm.scheduler.config.max_model_len
    assert llm.vocab_size == llm.model.config.vocab_size
    assert llm.tuple_values()["mode"] == {"name": "detent"}


def test_rescore_equals_generation_through_the_contract(llm: LLM) -> None:
    engine: Engine = llm
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (int(n),), generator=gen).tolist() for n in (5, 23, 40)]
    params = [SamplingParams(temperature=t, seed=11 + i, max_tokens=7, ignore_eos=True)
              for i, t in enumerate((0.0, 0.8, 1.1))]
    outs = engine.generate(prompts, params)
    scored = engine.rescore_batch([(p, o.token_ids) for p, o in zip(prompts, outs)], params)
    for o, s in zip(outs, scored):
        assert s.tokens == o.token_ids
        assert torch.equal(torch.tensor(s.logprobs, dtype=torch.float32),
                           torch.tensor(o.logprobs, dtype=torch.float32))


@pytest.fixture(scope="module")
def served(llm: LLM, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("served")
    key = generate_key(root / "node.key")
    node = ServingNode(llm, load_private_key(key.private_path), root / "out")
    (root / "in.jsonl").write_text(json.dumps({"id": "r0", "prompt_token_ids": [5, 6, 7, 8],
                                               "max_tokens": 4}))
    serve_offline(llm, node, root / "in.jsonl", root / "out.jsonl")
    node.close()
    return {"root": root, "key": key, "receipt": root / "out" / "receipts" / "r0.receipt"}


def _with_engine(served: dict, name: str, version: str = "9.9.9"):
    trusted = load_trusted_keys(served["key"].public_path)
    r = verify_envelope(served["receipt"].read_bytes(), trusted).receipt
    facts = json.loads(json.dumps(r.deployment_facts, default=dict))
    facts["engine"] = {**facts["engine"], "name": name, "version": version}
    return r, facts


@pytest.mark.parametrize("name", ["tgi", "", "vllm"])  # SGLang is known: its receipts are rebuilt
def test_verify_refuses_an_engine_it_cannot_rebuild(served, monkeypatch, tmp_path, name: str) -> None:
    import detent_audit.integrations.vllm as vllm_pkg
    from detent_audit.manifests.encoding import facts_hash

    monkeypatch.setattr(vllm_pkg, "vllm_available", lambda: False)  # as on a verifier without the extra
    r, facts = _with_engine(served, name)
    with pytest.raises(NotComparable) as err:
        reconstruct(facts, r.tuple_values, None)
    assert err.value.fields == ["engine.name"]
    assert ("not installed" in err.value.message) == (name == "vllm")
    forged = dataclasses.replace(r, deployment_facts=facts, deployment_hash=facts_hash(facts))
    path = tmp_path / "r0.receipt"  # a receipt's file is named by its request
    path.write_bytes(sign_receipt(forged, load_private_key(served["key"].private_path)))
    res = runner.invoke(app, ["verify", str(path), "--key", str(served["key"].public_path), "--json"])
    assert res.exit_code == 3, res.stdout
    outcome = json.loads(res.stdout)["outcomes"][0]
    assert outcome["status"] == "NOT_COMPARABLE" and outcome["fields"] == ["engine.name"]


def test_embedded_engine_version_differs_is_not_comparable(served, llm: LLM) -> None:
    r, facts = _with_engine(served, EMBEDDED, "0.0.0-other")
    with pytest.raises(NotComparable) as err:
        reconstruct(facts, r.tuple_values, llm.config.model, llm.config.cache_dir)
    assert err.value.fields == ["engine.version"]


class _Stalling:
    """An engine whose scheduler gives up with a request still live (the shared loop must say so, not
    spin)."""

    name = "stalling"

    def __init__(self) -> None:
        self.steps = 0

    def add_request(self, prompt, params, request_id=None):
        return dataclasses.make_dataclass("H", ["seq_id", "request_id"])(0, "r")

    def has_unfinished(self) -> bool:
        return self.steps < 3

    def step(self) -> list:
        self.steps += 1
        return []


def test_run_and_generate_are_one_implementation_over_the_contract(llm: LLM) -> None:
    """Every engine's run/generate are the contract's functions (through EngineBase): the embedded engine's
    outputs through contract.generate equal LLM.generate's, a parameter count mismatch is BadInput, a stalled
    engine raises."""
    from detent_audit.errors import BadInput
    from detent_audit.runtime import contract

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    params = [SamplingParams(temperature=0.0, max_tokens=4),
              SamplingParams(temperature=0.8, seed=3, max_tokens=4)]
    direct = llm.generate(prompts, params)
    shared = contract.generate(llm, prompts, params, default=SamplingParams(temperature=0.0))
    for a, b in zip(direct, shared, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    one = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert one[0].token_ids == direct[0].token_ids and len(one) == 2
    with pytest.raises(BadInput, match="2 prompts but 1"):
        llm.generate(prompts, params[:1])
    with pytest.raises(RuntimeError, match="stalling engine stopped"):
        contract.generate(_Stalling(), [[1]], None, default=SamplingParams(), name="stalling")
    from detent_audit.integrations.hosted import HostedEngine
    from detent_audit.integrations.sglang.engine import SglangEngine
    from detent_audit.runtime.base import EngineBase

    engines = [LLM, SglangEngine]
    try:
        from detent_audit.integrations.vllm.engine import VllmEngine
    except ImportError:
        pass
    else:
        engines.append(VllmEngine)
    for engine in engines:  # nobody writes its own: every engine runs the base's run and generate
        assert engine.run is EngineBase.run and engine.generate is EngineBase.generate, engine
        assert engine.num_threads is EngineBase.num_threads and engine.mode is EngineBase.mode, engine
    for engine in engines[1:]:
        for name in ("max_model_len", "vocab_size", "model_name", "model_positions", "tuple_values",
                     "top_logprobs_so_far"):
            assert getattr(engine, name) is getattr(HostedEngine, name), (engine, name)
