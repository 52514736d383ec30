"""The GPU attention's streaming fold is a bit-relevant fact: it is refused off the GPU, it names the
deployment's attention backend (so the deployment hash, and a receipt, carry it), and a verifier's
reconstruction of the engine turns it back on."""

from __future__ import annotations

import pytest

from detent_audit.engine.llm import EngineConfig
from detent_audit.engine.registration import engine_config
from detent_audit.enums import Mode
from detent_audit.errors import BadInput
from detent_audit.runtime.kernel_select import engine_deployment, select_kernels
from detent_audit.runtime.model_config import NAMED_SHAPES
from detent_audit.runtime.rebuild import RebuildRequest
from detent_audit.selection.programs.embedded import GPU_MAX_SPLITS, MAX_SPLITS


def _deployment(backend: str):
    return engine_deployment(NAMED_SHAPES["llama-3.1-8b"], dtype="bfloat16", num_threads=1, block_size=16,
                             max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=2048,
                             prefix_caching=True, attention_backend=backend)


def test_streaming_is_refused_on_the_cpu() -> None:
    with pytest.raises(BadInput, match="GPU attention"):
        EngineConfig(device="cpu", attention_streaming=True)


def test_streaming_is_a_deployment_fact_the_verifier_reads_back() -> None:
    plain, streaming = _deployment("detent"), _deployment("detent-streaming")
    assert plain.facts_hash() != streaming.facts_hash()
    for dep, expected in ((plain, False), (streaming, True)):
        facts = {"deployment": dep.to_canonical(), "checkpoint": {"generated": "random:llama-3.1-8b"},
                 "scheduler": {"block_size": 16, "max_num_batched_tokens": 2048, "max_prefill_chunk": 0,
                               "prefix_caching": True},
                 "runtime": {"device": "NVIDIA H200 sm90", "dtype": "bfloat16", "num_threads": 1}}
        config = engine_config(RebuildRequest(facts, {"mode": {"name": "detent"}}))
        assert config.attention_streaming is expected and config.device == "cuda"


@pytest.mark.parametrize(("max_model_len", "stride"), [(2048, 64), (4096, 64), (8192, 128), (131072, 2048)])
def test_the_streaming_kernel_commits_the_smallest_stride_its_split_bound_allows(max_model_len: int,
                                                                                  stride: int) -> None:
    """With the streaming fold (the GPU kernel) the default tuple splits every 64 tokens, or at the smallest
    stride that keeps a sequence within the GPU kernel's split bound; the CPU kernel's stays 4096 (or what
    its own bound allows)."""
    def committed(backend: str, length: int) -> int:
        dep = engine_deployment(NAMED_SHAPES["llama-3.1-8b"], dtype="bfloat16", num_threads=1, block_size=16,
                                max_model_len=length, max_num_seqs=32, max_num_batched_tokens=2048,
                                prefix_caching=True, attention_backend=backend)
        a = select_kernels(Mode.DETENT, dep).tuple["embedded.attention"]
        return a["tiles_per_split"] * a["embedded.attention.kv_tile"]

    assert committed("detent-streaming", max_model_len) == stride
    assert -(-max_model_len // stride) <= GPU_MAX_SPLITS
    assert committed("detent", max_model_len) == max(4096, max_model_len // MAX_SPLITS)


@pytest.mark.parametrize("backend", ["detent", "detent-streaming"])
def test_a_tuple_that_names_the_stride_alone_runs_that_stride(backend: str) -> None:
    """The kernels read the pinned tiles per split: a committed stride without it gets the pin it means,
    not the preferences' (which would run the default stride under the named one)."""
    dep = engine_deployment(NAMED_SHAPES["llama-3.1-8b"], dtype="bfloat16", num_threads=1, block_size=16,
                            max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=2048,
                            prefix_caching=True, attention_backend=backend)
    for stride in (256, 512, 4096):
        named = {"embedded.attention": {"embedded.attention.split_stride": stride}}
        a = select_kernels(Mode.DETENT, dep, named).tuple["embedded.attention"]
        assert a["tiles_per_split"] * a["embedded.attention.kv_tile"] == stride
