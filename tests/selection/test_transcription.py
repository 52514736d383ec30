"""The programs say what the engines do: NCCL only on a pinned path, SGLang's all-reduce as one value, SGLang's
FA3 build (sgl-attn) and its page-table max_seqlen_k, vLLM's cascade attention, the MoE switches, FlashInfer's
planner. Each test fails on a transcription that misses the upstream behaviour."""

from __future__ import annotations

import dataclasses

import pytest

from detent_audit.manifests.deployment import load_deployment, shipped_deployments
from detent_audit.selection.compiler import solve
from detent_audit.selection.lang import SelectionFailure
from detent_audit.selection.programs import all_reduce, families_for


def dep(name: str):
    return load_deployment(shipped_deployments()[name])


def solved(name: str, family: str, deployment=None):
    d = deployment or dep(name)
    spec = next(s for s in families_for(d) if s.name == family)
    return spec, solve(spec.program, spec.facts(d), family=spec.name)


# ---- all-reduce ----

def test_vllm_tp4_default_never_takes_nccl_by_size() -> None:
    _, r = solved("llama-3.1-70b-instruct-tp4-h100-vllm", "all_reduce")
    sel = r.selector()
    paths = {sel(n, n).path for n in range(1, 8193, 7)} | {sel(8192, 8192).path}
    assert len(paths) == 1 and not next(iter(paths)).startswith("nccl"), paths
    assert all(a["path"] != "nccl/tuner" for a in r.legal_assignments())


def test_nccl_is_legal_only_pinned() -> None:
    # the same deployment with NCCL_ALGO / NCCL_PROTO / channels pinned: NCCL becomes a legal path
    d = dep("llama-3.1-70b-instruct-tp4-h100-vllm")
    pinned = dataclasses.replace(d, engine=dataclasses.replace(d.engine, nccl_algo="allreduce:tree",
                                                               nccl_proto="Simple", nccl_channels=4))
    assert all_reduce.facts(pinned).nccl_path == "nccl/allreduce:tree.Simple.4ch"
    _, r = solved("", "all_reduce", pinned)
    assert "nccl/allreduce:tree.Simple.4ch" in {a["path"] for a in r.legal_assignments()}
    # algorithm pinned but not the protocol: still NCCL's choice by size
    half = dataclasses.replace(d, engine=dataclasses.replace(d.engine, nccl_algo="allreduce:tree"))
    assert all_reduce.facts(half).nccl_path == ""
    bi = dataclasses.replace(d, engine=dataclasses.replace(d.engine, batch_invariant=True))
    assert all_reduce.facts(bi).nccl_path == "nccl/tree.Simple.1ch"


SGLANG_PATHS = {"custom/1shot_push", "custom/1shot_pull", "custom/2shot_pull_mc", "custom/2shot_pull"}


def test_sglang_all_reduce_is_one_value_and_only_upstream_pairs() -> None:
    spec, r = solved("llama-3.1-70b-instruct-tp4-h100-sglang", "all_reduce")
    facts = spec.facts(dep("llama-3.1-70b-instruct-tp4-h100-sglang"))
    assert [p["name"] for p in r.pins] == ["path"]
    legal = {a["path"] for a in r.legal_assignments()}
    assert legal <= SGLANG_PATHS | {facts.nccl_path} and legal
    # the unpinned program produces only upstream pairs too, at every size, in and out of CUDA graphs
    seen = {spec.program(facts, n, g, n).path for n in range(1, 8193, 31) for g in (0, 1)}
    assert seen <= SGLANG_PATHS | {facts.nccl_path}


def test_sglang_without_pinned_nccl_has_no_legal_all_reduce() -> None:
    d = dep("llama-3.1-70b-instruct-tp4-h100-sglang")
    bare = dataclasses.replace(d, engine=dataclasses.replace(d.engine, nccl_algo="", nccl_proto="",
                                                             nccl_channels=0))
    _, r = solved("", "all_reduce", bare)
    assert r.legal_count == 0 and r.default is None  # 128 MiB steps exceed every workspace: NCCL by size
    with pytest.raises(SelectionFailure, match="NCCL picks"):
        all_reduce.all_reduce_sglang(all_reduce.facts(bare), 8192, 0, 8192)
