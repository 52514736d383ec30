"""GPU tier: decode steps replayed from CUDA graphs at every capture size up to max_num_seqs give the eager
step's bits, and a request's bits do not depend on the size its batch replayed at. Skipped without CUDA."""

from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("detent_audit.kernels.triton_attention")

from detent_audit.engine.llm import LLM, EngineConfig  # noqa: E402
from detent_audit.runtime.sampling_params import SamplingParams  # noqa: E402

SEATS = 64


def engine(cuda_graphs: bool, **kw) -> LLM:
    return LLM(EngineConfig(model="random:tiny-llama", device="cuda", dtype="bfloat16", mode="detent",
                            max_num_seqs=SEATS, max_num_batched_tokens=512, num_kv_blocks=1024,
                            max_model_len=512, cuda_graphs=cuda_graphs, **kw))


def requests(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(3, 60))] for _ in range(n)]
    # outputs of many lengths: rows finish at different steps, so the batch shrinks through the sizes
    # and some end by a token: their step queued ahead is dropped
    stops = tuple(rng.sample(range(256), 12))
    params = [SamplingParams(temperature=0.8 if i % 3 else 0.0, seed=seed * 1000 + i,
                             logprobs=3 if i % 4 == 1 else None, max_tokens=rng.randint(1, 40),
                             ignore_eos=True, stop_token_ids=stops if i % 5 == 2 else ()) for i in range(n)]
    return prompts, params


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs


def test_replayed_steps_at_every_size_give_the_eager_bits() -> None:
    seed = int(torch.randint(0, 1 << 20, ()))
    prompts, params = requests(SEATS, seed)
    graphed_llm = engine(True)
    graphed = graphed_llm.generate(prompts, params)
    sizes = set(graphed_llm.runner.graphs.graphs)
    assert len(sizes) >= 4 and max(sizes) > 32  # the walk replayed many sizes, past the old limit of 32
    eager = engine(False).generate(prompts, params)
    assert all(same(a, b) for a, b in zip(graphed, eager)), f"seed {seed}"


def test_a_request_gets_its_bits_at_every_batch_size() -> None:
    seed = int(torch.randint(0, 1 << 20, ()))
    prompts, params = requests(SEATS, seed)
    params = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=24, ignore_eos=True)
              for p in params]  # every request runs to 24 tokens
    llm = engine(True)
    alone = llm.generate(prompts[:1], params[:1])[0]
    for n in (5, 33, SEATS):  # replays at sizes 8, 40, 64
        llm.reset()
        assert same(llm.generate(prompts[:n], params[:n])[0], alone), f"batch {n}, seed {seed}"
    assert {1, 8, 40, SEATS} <= set(llm.runner.graphs.graphs)


def test_graph_max_batch_bounds_the_captured_sizes() -> None:
    prompts, params = requests(12, seed=3)
    llm = engine(True, graph_max_batch=4)
    assert llm.runner.graphs.sizes == (1, 2, 4)
    eager = engine(False).generate(prompts, params)
    assert all(same(a, b) for a, b in zip(llm.generate(prompts, params), eager))


def test_a_graph_keeps_the_inputs_it_was_captured_with() -> None:
    """A graph reads tensors allocated outside its capture (the slots, the step plan). Once the kernels'
    current plan has moved on, only the graph holds them: memory handed out again since (here: junk of
    every small size) must neither reach a replay nor be written by one."""
    seed = int(torch.randint(0, 1 << 20, ()))
    prompts, params = requests(SEATS, seed)
    eager = engine(False).generate(prompts, params)
    llm = engine(True)
    assert all(same(a, b) for a, b in zip(llm.generate(prompts, params), eager)), f"seed {seed}"
    llm.reset()
    llm.selection.kernels._plan = None
    gc.collect()
    torch.cuda.empty_cache()
    junk = [torch.full((n,), (1 << 40) + n, dtype=torch.int64, device="cuda") for n in range(1, 1024)
            for _ in range(4)]
    again = llm.generate(prompts, params)
    torch.cuda.synchronize()
    assert all(same(a, b) for a, b in zip(again, eager)), f"seed {seed}"
    assert all(bool((t == (1 << 40) + t.numel()).all()) for t in junk)


def test_an_abort_while_a_step_is_queued_ahead_keeps_the_others_bits(until_queued_ahead) -> None:
    seed = int(torch.randint(0, 1 << 20, ()))
    prompts, params = requests(16, seed)
    eager = engine(False).generate(prompts, params)
    llm = engine(True)
    handles = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    victim = max(range(16), key=lambda i: len(eager[i].token_ids))
    until_queued_ahead(llm, handles[victim], seed)
    llm.abort(handles[victim])
    llm.run([h for i, h in enumerate(handles) if i != victim and not h.is_finished])
    assert handles[victim].output_token_ids == eager[victim].token_ids[:handles[victim].num_output_tokens]
    for i, h in enumerate(handles):
        if i != victim:
            assert same(llm.output_of(h), eager[i]), f"request {i}, seed {seed}"
