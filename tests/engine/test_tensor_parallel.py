"""Tensor parallelism: a TP=N forward over gloo processes equals its rank emulation in one process, bit for
bit (each rank's partial, each ordered sum, the logprobs), and differs from a plain TP=1 forward."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from detent_audit.engine.generated import generate_model
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.tensor_parallel import EmulatedRanks, TPLayout, ordered_sum, tensor_parallel_model
from detent_audit.engine.tp_ranks import ProcessRanks, free_port
from detent_audit.errors import BadInput
from detent_audit.runtime.model_config import ModelConfig
from detent_audit.runtime.sampling_params import SamplingParams

PROMPTS = ["the tensor-parallel ranks add their partials in order", "a short one", "seventeen seventeen x"]


def _bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


def _record(cls: type, calls: list) -> None:
    """Wrap `cls.all_reduce` so every call's partials and sum are kept in `calls`."""
    inner = cls.all_reduce

    def all_reduce(self, partials: list[torch.Tensor]) -> torch.Tensor:
        out = inner(self, partials)
        calls.append(([p.clone() for p in partials], out.clone()))
        return out

    cls.all_reduce = all_reduce  # type: ignore[method-assign]


def _config(model: str, size: int, **kw: object) -> EngineConfig:
    return EngineConfig(model=model, num_threads=1, tensor_parallel_size=size, **kw)  # type: ignore[arg-type]


def _rank_main(model: str, size: int, rank: int, init: str, out: str, seed: int) -> None:
    """One rank of a launcher-started group: rank 0 generates, the others follow; each saves its calls."""
    calls: list = []
    _record(ProcessRanks, calls)
    llm = LLM(_config(model, size, tensor_parallel_rank=rank, tensor_parallel_init=init))
    outputs = None
    if rank == 0:
        params = [SamplingParams(temperature=0.8, seed=seed + i, max_tokens=6) for i in range(len(PROMPTS))]
        outputs = [o.logprobs for o in llm.generate(PROMPTS, params)]
        llm.shutdown()
    else:
        from detent_audit.engine.tp_ranks import follow

        assert llm.rank_group is not None
        follow(llm.model, llm.rank_group, llm.runner.kv_caches, llm.selection.kernels)  # type: ignore[arg-type]
    torch.save({"calls": calls, "outputs": outputs}, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _run_ranks(model: str, size: int, out: Path, seed: int) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(model, size, r, init, str(out), seed)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0] * size
    return [torch.load(out / f"rank{r}.pt") for r in range(size)]


@pytest.mark.parametrize(("model", "size"), [("random:tiny-qwen3-moe", 2), ("random:tiny-llama", 4)])
def test_each_ranks_partial_and_every_ordered_sum_equal_the_rank_emulation(model: str, size: int,
                                                                           tmp_path: Path) -> None:
    """tiny-qwen3-moe splits experts and replicates nothing; tiny-llama at 4 ranks replicates its 2
    KV heads."""
    seed = int.from_bytes(os.urandom(4), "little")  # fresh sampling seeds each run
    ranks = _run_ranks(model, size, tmp_path, seed)
    emulated_calls: list = []
    _record(EmulatedRanks, emulated_calls)
    llm = LLM(_config(model, size, tensor_parallel_ranks="emulated"))
    params = [SamplingParams(temperature=0.8, seed=seed + i, max_tokens=6) for i in range(len(PROMPTS))]
    emulated = [o.logprobs for o in llm.generate(PROMPTS, params)]
    for r, rank in enumerate(ranks):
        assert len(rank["calls"]) == len(emulated_calls)
        for (partials, total), (mine, their_total) in zip(emulated_calls, rank["calls"], strict=True):
            assert torch.equal(partials[r], mine[0])
            assert torch.equal(total, their_total)
    for served, again in zip(ranks[0]["outputs"], emulated, strict=True):
        assert torch.equal(_bits(served), _bits(again))


def test_the_ordered_sum_adds_in_rank_order_in_float32() -> None:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    halves = [torch.randn(64, 32, generator=g).to(torch.bfloat16) for _ in range(3)]
    assert torch.equal(ordered_sum(halves), ((halves[0].float() + halves[1].float()) + halves[2].float())
                       .to(torch.bfloat16))
    parts = [torch.randn(64, 32, generator=g) * scale for scale in (1.0, 1e4, 1e-3)]  # fp32 partials
    expected = (parts[0] + parts[1]) + parts[2]
    assert torch.equal(ordered_sum(parts), expected)
    # another order gives other bits somewhere (why the order is a fact)
    orders = [ordered_sum([parts[i] for i in perm]) for perm in ((1, 2, 0), (2, 0, 1), (0, 2, 1))]
    assert any(not torch.equal(o, expected) for o in orders)


def test_a_plain_tp1_forward_differs_from_the_tp2_bits() -> None:
    """What every other engine does: re-run at TP=1 and compare. The bits differ; emulation is needed."""
    outs = {}
    for size in (1, 2):
        kw = {"tensor_parallel_ranks": "emulated"} if size > 1 else {}
        llm = LLM(_config("random:default-20m", size, **kw))
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
        outs[size] = [o.logprobs for o in outputs]
    assert any(not torch.equal(_bits(a), _bits(b)) for a, b in zip(outs[1], outs[2], strict=True))


def test_a_split_that_does_not_divide_is_refused_naming_both_numbers() -> None:
    smol_shape = ModelConfig.from_name("default-20m")  # 8 heads, 4 KV heads, MLP 1536, vocab 512
    with pytest.raises(BadInput,
                       match=r"tensor_parallel_size 3 does not divide the model's num_attention_heads \(8\)"):
        TPLayout(smol_shape, 3)
    with pytest.raises(BadInput, match=r"tensor_parallel_size 3 does not divide"):
        LLM(_config("random:default-20m", 3, tensor_parallel_ranks="emulated"))


def test_every_shard_parameter_is_cut_and_kv_heads_are_replicated_in_groups() -> None:
    full = generate_model("random:tiny-llama", torch.float32, "cpu")  # 4 heads, 2 KV heads
    tp = tensor_parallel_model(full, 4)
    layout = tp.layout
    assert [layout.first_kv_head(r) for r in range(4)] == [0, 0, 1, 1]
    d = full.config.head_dim
    for r, shard in enumerate(tp.shards):
        qkv = shard.layers[0].self_attn.qkv_proj.weight
        full_qkv = full.layers[0].self_attn.qkv_proj.weight
        assert torch.equal(qkv[:d], full_qkv[r * d:(r + 1) * d])             # its query head
        k0 = full.config.num_attention_heads * d + layout.first_kv_head(r) * d
        assert torch.equal(qkv[d:2 * d], full_qkv[k0:k0 + d])                 # its group's KV head
        assert shard.embed_tokens.weight.shape[0] == full.config.vocab_size // 4


def test_the_all_reduce_is_a_selection_family_whose_only_legal_choice_is_the_ordered_sum() -> None:
    llm = LLM(_config("random:tiny-llama", 2, tensor_parallel_ranks="emulated"))
    result = llm.selection.results["embedded.all_reduce"]
    legal = {k.name: k.legal_values for k in result.knobs} | {p.name: p.legal_values for p in result.pins}
    assert legal["embedded.all_reduce.algorithm"] == ("ordered-gather-sum",)
    assert llm.tuple_values()["embedded.all_reduce"] == {
        "embedded.all_reduce.algorithm": "ordered-gather-sum"}
    assert llm.facts()["parallel"] == {"tensor_parallel_size": 2, "all_reduce": "ordered-gather-sum",
                                       "accumulate": "float32"}
    assert "embedded.all_reduce" not in LLM(_config("random:tiny-llama", 1)).tuple_values()
