"""Deployment facts: every shipped file loads, every defect is a BadDeployment naming file, section and field,
and the facts hash is canonical and covers every fact."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from detent_audit.errors import BadInput
from detent_audit.manifests.deployment import (
    BadDeployment,
    Deployment,
    load_deployment,
    shipped_deployments,
)

EXPECTED = {
    "llama-3.1-70b-instruct-tp4-h100-sglang", "llama-3.1-70b-instruct-tp4-h100-vllm",
    "llama-3.1-70b-instruct-tp8-h100-vllm", "qwen3-30b-a3b-tp4-h100-vllm", "qwen3-14b-tp4-h100-vllm",
    "qwen3-8b-tp2-h100-vllm", "llama-3.2-1b-tp1-h100-vllm", "llama-3.1-8b-instruct-tp1-h100-vllm",
    "llama-3.1-8b-instruct-tp1-b200-vllm", "gemma-7b-it-tp1-h100-vllm", "phi-3.5-mini-instruct-tp1-h100-vllm",
}
LLAMA = "llama-3.1-70b-instruct-tp4-h100-vllm"


def _canonical(name: str = LLAMA) -> dict:
    return load_deployment(shipped_deployments()[name]).to_canonical()


def _fails(data: dict, source: str = "llama.toml") -> BadDeployment:
    with pytest.raises(BadDeployment) as info:
        Deployment.from_canonical(data, source=source)
    return info.value


@pytest.mark.parametrize("name", sorted(shipped_deployments()))
def test_every_shipped_file_loads_and_round_trips(name: str) -> None:
    dep = load_deployment(shipped_deployments()[name])
    assert dep.name == name
    assert Deployment.from_canonical(dep.to_canonical()) == dep
    assert dep.facts_hash() == load_deployment(shipped_deployments()[name]).facts_hash()
    assert len(dep.facts_hash()) == 64 and int(dep.facts_hash(), 16) >= 0


def test_the_required_deployments_ship() -> None:
    assert EXPECTED <= set(shipped_deployments())
    moe = load_deployment(shipped_deployments()["qwen3-30b-a3b-tp4-h100-vllm"])
    assert [k for k, _ in moe.tables.fused_moe][:5] == [1, 2, 4, 8, 16]
    assert dict(moe.tables.fused_moe)[1536].block_size_m == 128


def test_canonical_form_is_sorted_plain_and_hashed_as_compact_json() -> None:
    dep = load_deployment(shipped_deployments()["qwen3-1.7b-tp1-h100-vllm-bi"])
    canon = dep.to_canonical()
    assert list(canon) == sorted(canon) and list(canon["engine"]) == sorted(canon["engine"])
    assert isinstance(canon["engine"]["cuda_graph_capture_sizes"], list)
    text = dep.canonical_json()
    assert text == json.dumps(canon, sort_keys=True, separators=(",", ":")).encode("ascii")
    assert dep.facts_hash() == hashlib.sha256(text).hexdigest()


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k in value:
            yield from _leaves(value[k], (*path, k))
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path, value


def _alternatives(path, value):
    enums = {"arch": ["sm90"], "compute_capability": ["9.0"], "dtype": ["float16", "bfloat16"],
             "attention_backend": ["fa2", "triton", "flashinfer"],
             "custom_all_reduce_algo": ["1stage", "2stage"], "name": ["sglang", "vllm", "changed"],
             "fa3_source": ["owner/repo@0123abcd"]}
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value * 2, value + 1, value + 2, max(1, value - 1), 0, value * 4]
    if isinstance(value, str):
        return [v for v in enums.get(path[-1], []) if v != value] + [value + "-x"]
    if isinstance(value, list):
        return [value[:-1], value + [value[-1] + 16]] if value else [[1]]
    return []


def _set(data, path, value):
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


# facts with no other valid value when changed alone: the arch/capability pair, the engine that owns the FA
# fork, chunked prefill (the token budget is below max_model_len), an empty table array, a dense model's MoE
# fields (they change together); the other deployment covers each of those it can
_SINGLE_VALUED = {("gpu", "arch"), ("gpu", "compute_capability"), ("engine", "name"),
                  ("engine", "chunked_prefill")}
_DENSE_MOE = {("model", "num_experts"), ("model", "num_experts_per_tok"), ("model", "moe_intermediate_size")}


@pytest.mark.parametrize("name, untestable", [
    ("qwen3-30b-a3b-tp4-h100-vllm", _SINGLE_VALUED | {("tables", "matmul")}),
    ("qwen3-1.7b-tp1-h100-vllm-bi", _SINGLE_VALUED | _DENSE_MOE),
])
def test_facts_hash_changes_when_any_fact_changes(name: str, untestable: set) -> None:
    base = _canonical(name)
    base_hash = Deployment.from_canonical(base).facts_hash()
    untested = set()
    tested = 0
    for path, value in _leaves(base):
        for alt in [a for a in _alternatives(path, value) if a != value]:
            data = copy.deepcopy(base)
            _set(data, path, alt)
            try:
                changed = Deployment.from_canonical(data)
            except BadDeployment:
                continue
            assert changed.facts_hash() != base_hash, path
            tested += 1
            break
        else:
            untested.add(path)
    assert untested == untestable
    assert tested > 50


def test_missing_field_names_file_section_and_field(tmp_path: Path) -> None:
    text = shipped_deployments()[LLAMA].read_text()
    path = tmp_path / "llama.toml"
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("num_kv_heads")))
    with pytest.raises(BadDeployment) as info:
        load_deployment(path)
    assert info.value.message == "llama.toml: [model] is missing field 'num_kv_heads'"
    assert info.value.remedy == "add `num_kv_heads = <an integer>` under [model]"
    assert isinstance(info.value, BadInput)


def test_wrong_type_is_named_with_the_value() -> None:
    data = _canonical()
    data["model"]["num_heads"] = "64"
    assert _fails(data).message == ("llama.toml: [model] field 'num_heads' must be an integer, "
                                    "not a string ('64')")
    data = _canonical()
    data["engine"]["page_size"] = True       # a TOML boolean is not an integer
    assert _fails(data).message == ("llama.toml: [engine] field 'page_size' must be an integer, not a "
                                    "boolean (True)")
    data = _canonical()
    data["engine"]["cuda_graph_capture_sizes"] = [1, "2"]
    assert "field 'cuda_graph_capture_sizes' must be an array of integers" in _fails(data).message


def test_unknown_field_and_missing_section() -> None:
    data = _canonical()
    data["model"]["num_head"] = 64
    error = _fails(data)
    assert error.message == "llama.toml: [model] has unknown field 'num_head'"
    assert "num_heads" in error.remedy
    data = _canonical()
    del data["gpu"]
    assert _fails(data).message == "llama.toml: missing section [gpu] (or [cpu])"
    data = _canonical()
    data["tables"]["tuned_gemm"] = {}
    assert _fails(data).message == "llama.toml: [tables] has unknown table 'tuned_gemm'"


@pytest.mark.parametrize("section, field, value, message", [
    ("model", "num_kv_heads", 6, "[model] num_heads (64) must be a multiple of num_kv_heads (6)"),
    ("model", "hidden_size", 0, "[model] hidden_size (0) must be positive"),
    ("model", "dtype", "bf16", "[model] dtype 'bf16' must be one of ['bfloat16', 'float16', 'float32']"),
    ("gpu", "compute_capability", "8.0", "[gpu] compute_capability '8.0' does not match arch 'sm90' "
                                         "(expected one of ['9.0'])"),
    ("engine", "max_num_seqs", 100000, "[engine] max_num_batched_tokens (8192) must be at least max_num_seqs "
                                       "(100000)"),
    ("engine", "cuda_graph_capture_sizes", [1, 4, 2],
     "[engine] cuda_graph_capture_sizes must be positive and "
                                                      "strictly increasing"),
    ("parallel", "tensor_parallel_size", 3,
     "[parallel] tensor_parallel_size (3) must divide [model] num_heads (64)"),
    ("engine", "max_model_len", 200000,
     "[engine] max_model_len (200000) exceeds [model] max_position_embeddings "
                                        "(131072)"),
])
def test_bad_values_are_named(section: str, field: str, value, message: str) -> None:
    data = _canonical()
    data[section][field] = value
    assert _fails(data).message == f"llama.toml: {message}"


def test_bad_tables_are_named() -> None:
    data = _canonical("qwen3-30b-a3b-tp4-h100-vllm")
    data["tables"]["fused_moe"]["abc"] = data["tables"]["fused_moe"]["1"]
    assert _fails(data).message == "llama.toml: [tables.fused_moe] key 'abc' must be a positive token count"
    data = _canonical("qwen3-30b-a3b-tp4-h100-vllm")
    data["tables"]["fused_moe"]["8"]["num_warps"] = 0
    assert _fails(data).message == "llama.toml: [tables.fused_moe.8] num_warps (0) must be positive"
    data = _canonical("qwen3-1.7b-tp1-h100-vllm-bi")
    data["tables"]["matmul"][0]["buckets"].reverse()
    assert _fails(data).message == ("llama.toml: [tables.matmul.0] buckets must be non-empty with strictly "
                                    "increasing max_m")
    data = _canonical(LLAMA)
    data["tables"]["fused_moe"] = _canonical("qwen3-30b-a3b-tp4-h100-vllm")["tables"]["fused_moe"]
    assert _fails(data).message == "llama.toml: [tables] fused_moe: a fused-MoE table needs an MoE model"


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(BadDeployment, match=r"^nope\.toml: cannot read deployment file"):
        load_deployment(tmp_path / "nope.toml")
    bad = tmp_path / "llama.toml"
    bad.write_text("name = \n")
    with pytest.raises(BadDeployment, match=r"^llama\.toml: not valid TOML: "):
        load_deployment(bad)


def test_manifests_import_neither_torch_nor_the_engine() -> None:
    code = ("import sys, detent_audit.manifests.deployment; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('detent_audit.engine')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
