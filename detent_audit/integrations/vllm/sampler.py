"""Seeded sampling inside vLLM whose draw depends on (seed, position, vocabulary index) only.

vLLM's CPU sampler draws a seeded request from a per-request `torch.Generator` that advances once per step
(and a seeded request whose prefill is chunked crashes vLLM CPU: `gen.get_offset()` on a CPU generator). So
`VllmEngine` hands vLLM every detent request as greedy (temperature 0, no seed) and carries the request's own
sampling in `SamplingParams.extra_args[EXTRA_KEY]`. `DetentSampler`, a vLLM logits processor that is not
argmax-invariant, runs before vLLM's sampler: for each such row it draws the token with `kernels.sampling`
(counter-hash Gumbel over the raw logits at the absolute position of the token drawn) and leaves that
token the only finite logit, so vLLM's greedy argmax returns it. vLLM computes the logprobs it returns
(`raw_logprobs`: fp32 log-softmax of the raw logits) before any logits processor runs, so they are untouched.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from detent_audit.kernels import sampling

EXTRA_KEY = "detent_sampling"  # extra_args entry: {"seed", "temperature", "top_k", "top_p"}


class _Row(NamedTuple):
    seed: int
    temperature: float
    top_k: int
    top_p: float
    prompt_len: int
    output: list[int]   # vLLM's live list of the request's output tokens


def _row(params: Any, prompt: list[int] | None, output: list[int]) -> _Row | None:
    extra = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
    if not extra or extra["temperature"] == 0:
        return None
    seed = int(extra["seed"])  # a u64 seed as its two's-complement int64, as the embedded engine draws it
    return _Row(seed - (1 << 64) if seed >= 1 << 63 else seed, float(extra["temperature"]), int(extra["top_k"]),
                float(extra["top_p"]), len(prompt or ()), output)


class DetentSampler(LogitsProcessor):
    """The counter-hash draw for the rows that carry `EXTRA_KEY` with a temperature above 0."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        idx = sorted(i for i in self.rows if i < logits.shape[0])
        if not idx:
            return logits
        rows = [self.rows[i] for i in idx]
        # the token drawn now goes to absolute position prompt + outputs so far (the embedded engine's rule)
        tokens = sampling.sample(
            logits[idx].float(),
            torch.tensor([r.temperature for r in rows], dtype=torch.float32),
            torch.tensor([r.top_k for r in rows], dtype=torch.int64),
            torch.tensor([r.top_p for r in rows], dtype=torch.float32),
            torch.tensor([r.seed for r in rows], dtype=torch.int64),
            torch.tensor([r.prompt_len + len(r.output) for r in rows], dtype=torch.int64))
        index = torch.tensor(idx, dtype=torch.int64)
        logits[index] = -torch.inf
        logits[index, tokens] = 0.0
        return logits
