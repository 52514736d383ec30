"""The streaming attention's split stride and launch path in the engine's decode graphs, per batch size.

Each spec `KV_TILE:STRIDE:THRESHOLD` builds the 8B-shape engine (detent, streaming fold) with that KV tile and
split stride forced on every attention launch (pinned values: other bits than the default tuple's) and
`IN_PROGRAM_MIN_PROGRAMS` = THRESHOLD (launches of fewer (tile, KV head) programs run the splits in parallel
programs, `_attn_split_fold`; the others fold in one program per tile; the two give the same bits). For each
batch size B, B requests of 512 random tokens decode until the size's graph is captured, then the graph is
replayed 60 times: the median replay in ms. The tokens of two specs with the same tile and stride are
compared (they must be equal).

Usage (device): python3 benchmarks/gpu_attention_strides.py "64:4096:264;64:64:128" 1,8,32,256
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys

import torch

import detent_audit.kernels.gpu as gpu_kernels
import detent_audit.kernels.triton_attention as ta
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_decode_loop import event_ms  # noqa: E402

ENGINE_CONFIG = gpu_kernels.selected_attention_config


def replay_ms(llm: LLM, b: int) -> tuple[float, list[tuple[int, ...]]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(512)] for _ in range(b)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    seqs = [llm.add_request(p, greedy) for p in prompts]
    while not all(s.num_output_tokens >= 4 for s in seqs):  # prefilled, the size's graph captured
        llm.step()
    graphs = llm.runner.graphs
    assert graphs is not None
    torch.cuda.synchronize()
    ms = event_ms(graphs.graphs[graphs.size_for(b)].replay, 60)
    while llm.has_unfinished():
        llm.step()
    return ms, [tuple(s.output_token_ids) for s in seqs]


def main() -> None:
    specs = sys.argv[1].split(";")
    batches = [int(x) for x in sys.argv[2].split(",")]
    tokens: dict[tuple[str, int], list] = {}
    for spec in specs:
        kv_tile, stride, threshold = (int(x) for x in spec.split(":"))
        ta.IN_PROGRAM_MIN_PROGRAMS = threshold

        def forced(params, streaming=False, decode=False, kv_tile=kv_tile, stride=stride):
            config = ENGINE_CONFIG(params, streaming, decode)
            return dataclasses.replace(config, block_n=kv_tile, split=stride)

        gpu_kernels.selected_attention_config = forced  # type: ignore[assignment]
        llm = LLM(EngineConfig(model="random:llama-3.1-8b", device="cuda", dtype="bfloat16", mode="detent",
                               max_num_seqs=max(batches), max_num_batched_tokens=8192,
                               num_kv_blocks=max(4096, max(batches) * 40), max_model_len=4096,
                               attention_streaming=True))
        cells = []
        for b in batches:
            ms, tokens[(spec, b)] = replay_ms(llm, b)
            cells.append(f"b={b} {ms:.3f} ms")
        print(f"{spec}: " + ", ".join(cells), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    gpu_kernels.selected_attention_config = ENGINE_CONFIG
    for i, a in enumerate(specs):
        for b_spec in specs[i + 1:]:
            if a.split(":")[:2] == b_spec.split(":")[:2]:
                same = all(tokens[(a, b)] == tokens[(b_spec, b)] for b in batches)
                print(f"{a} and {b_spec}: same tokens {same}")


if __name__ == "__main__":
    main()
