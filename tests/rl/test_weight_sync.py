"""Weights loaded in place between steps: the prefix cache dropped, the facts (and a served receipt) naming
the new weights' digest, and a rollout of the old weights refused when scored with the new ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from detent_audit.engine.llm import LLM
from detent_audit.engine.sequence import Sequence
from detent_audit.engine.weight_sync import weights_digest
from detent_audit.manifests.receipt import ClientRequest
from detent_audit.rl.gate import LogprobMismatch, ParityGate
from detent_audit.rl.scorer import Scorer
from detent_audit.runtime.errors import BadCheckpoint
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.server.node import ServingNode

API = "detent/v1/offline-jsonl"


def perturbed(llm: LLM, seed: int) -> dict[str, torch.Tensor]:
    """The engine's weights in the checkpoint's names, q/k/v and gate/up split, with fresh noise added."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in llm.model.named_parameters():
        new = p.detach() + 1e-3 * torch.randn(p.shape, generator=g)
        if name.endswith("qkv_proj.weight"):
            a = llm.model.get_submodule(name.rpartition(".")[0])
            layer = name.split(".")[1]
            q, k, v = new.split([a.parts["q"], a.parts["k"], a.parts["v"]])
            out |= {f"model.layers.{layer}.self_attn.{x}_proj.weight": t for x, t in zip("qkv", (q, k, v))}
        else:
            out[name] = new  # the engine's own names are taken too
    return out


def test_load_weights_changes_the_facts_and_the_served_receipt(tmp_path: Path) -> None:
    llm = LLM(model="random:tiny-llama")
    before = llm.facts()["checkpoint"].get("weights")  # a generated model: none (its config names it)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=3, ignore_eos=True)
    prompt = list(range(5, 25))  # over one KV block: the prefix cache holds it after the request
    body = {"prompt_token_ids": prompt, "max_tokens": 3, "seed": 5, "temperature": 1.0, "ignore_eos": True}
    node = ServingNode(llm, Ed25519PrivateKey.generate(), tmp_path / "out")
    (old,) = llm.generate([prompt], params)
    probe = Sequence(0, prompt, params)
    assert llm.scheduler.block_manager.match_prefix(probe).block_ids
    first = node.sign(old, params, "old", ClientRequest.of(API, body))
    new_weights = perturbed(llm, 1)
    digest = llm.load_weights(new_weights)
    assert digest == weights_digest(llm.model) != before
    assert llm.facts()["checkpoint"]["weights"] == digest
    assert not llm.scheduler.block_manager.match_prefix(probe).block_ids  # the prefix cache was dropped
    (new,) = llm.generate([prompt], params)
    second = node.sign(new, params, "new", ClientRequest.of(API, body))
    assert first.receipt.deployment_facts["checkpoint"].get("weights") == before
    assert second.receipt.deployment_facts["checkpoint"]["weights"] == digest
    assert first.receipt.deployment_hash != second.receipt.deployment_hash
    # the same weights give the same digest; one flipped bit another
    assert llm.load_weights(new_weights) == digest
    name = "layers.0.mlp.down_proj.weight"
    flipped = new_weights[name].clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    assert llm.load_weights({name: flipped}) != digest


def test_a_rollout_of_the_old_weights_is_refused_when_scored_with_the_new() -> None:
    llm = LLM(model="random:tiny-llama")
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=4, ignore_eos=True) for i in range(3)]
    outs = llm.generate([[3, 4, 5], [9, 8], [7, 7, 7, 7]], params)
    scorer = Scorer(llm)
    pairs = [(o.prompt_token_ids, o.token_ids) for o in outs]
    gate = ParityGate()
    report = gate.check([o.logprobs for o in outs], scorer.score(pairs).logprobs)
    assert report.mismatched == 0 and report.tokens == 12
    llm.load_weights(perturbed(llm, 2))
    with pytest.raises(LogprobMismatch, match=r"sample 0, position 0: rollout logprob .* \(0x[0-9a-f]{8}\) "
                                              r"but trainer .* \(0x[0-9a-f]{8}\)"):
        gate.check([o.logprobs for o in outs], scorer.score(pairs).logprobs)


def test_load_weights_refuses_an_unknown_name() -> None:
    llm = LLM(model="random:tiny-llama")
    with pytest.raises(BadCheckpoint, match="model.layers.0.mlp.nope.weight"):
        llm.load_weights({"model.layers.0.mlp.nope.weight": torch.zeros(2)})
