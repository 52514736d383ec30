"""Seeded sampling inside vLLM whose draw depends on (seed, position, vocabulary index) only.

vLLM's CPU sampler draws a seeded request from a per-request `torch.Generator` that advances once per step
(and a seeded request whose prefill is chunked crashes vLLM CPU: `gen.get_offset()` on a CPU generator). So
`VllmEngine` hands vLLM every detent request as greedy (temperature 0, no seed) and carries the request's own
sampling in `SamplingParams.extra_args[EXTRA_KEY]`. `DetentSampler`, a vLLM logits processor that is not
argmax-invariant, runs before vLLM's sampler: for each such row it draws the token with `kernels.sampling`
(counter-hash Gumbel over the raw logits at the absolute position of the token drawn) and leaves that
token the only finite logit, so vLLM's greedy argmax returns it. vLLM computes the logprobs it returns
(`raw_logprobs`: fp32 log-softmax of the raw logits) before any logits processor runs, so they are untouched.

Teacher-forced rescore (detent mode) scores the output positions of one prefill of prompt + output in the
model runner itself. A rescore request (prompt + output but its last token, the target of its last row)
carries `RESCORE_KEY` (its sampling, the original prompt's length, the top-n asked, that last token, a tag);
`score_rescore_rows`, which the plugin runs at every step just before vLLM's own prompt-logprobs point
(`GPUModelRunner._get_prompt_logprobs_dict`, a wrapper; the CPU runner inherits it), takes the hidden states
of the rows predicting output positions and computes, with vLLM's own functions, what generation computed
there: the raw logits (`model.compute_logits`, row-invariant), the fp32 logprobs (`sampler.compute_logprobs`),
the served token's logprob and the top-n (`sampler.gather_logprobs`), and the token drawn (greedy: the argmax
of the logits, as vLLM's greedy sampler; sampled: the counter-hash draw of `DetentSampler`), so the draw is
checked at every output position. Only those rows go through the LM head: vLLM's prompt logprobs would run
it, a log-softmax and a top-k over every prompt position, and return no logits row to draw from. The scores
come back to `VllmEngine` through this module (`take_worker_scores`, called in every worker by vLLM's
`collective_rpc`: in the engine's own process at TP=1, in each rank's worker process at TP > 1, where every
rank scores alike from the gathered logits and rank 0's are taken); a rescore whose scores did not come back
is an error, never a pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from detent_audit.kernels import sampling

EXTRA_KEY = "detent_sampling"  # extra_args entry: {"seed", "temperature", "top_k", "top_p"}
RESCORE_KEY = "detent_rescore"  # a rescore's extra_args: EXTRA_KEY's, "prompt_len", "top_n", "last", "tag"

_draws: dict[str, dict[int, int]] = {}  # tag -> absolute position -> the token drawn there (this process)


class _Row(NamedTuple):
    seed: int
    temperature: float
    top_k: int
    top_p: float
    prompt_len: int
    output: list[int]   # vLLM's live list of the request's output tokens


def _signed_seed(seed: int) -> int:
    """A u64 seed as its two's-complement int64, as the embedded engine draws it."""
    seed = int(seed)
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _row(params: Any, prompt: list[int] | None, output: list[int]) -> _Row | None:
    extra = (params.extra_args or {}).get(EXTRA_KEY) if params is not None else None
    if not extra or extra["temperature"] == 0:
        return None
    return _Row(_signed_seed(extra["seed"]), float(extra["temperature"]), int(extra["top_k"]),
                float(extra["top_p"]), len(prompt or ()), output)


def _draw(logits: torch.Tensor, spec: dict, positions: torch.Tensor) -> torch.Tensor:
    """The draw of rows of raw logits for one request's sampling at absolute `positions` (temperature 0: the
    argmax, as vLLM's greedy sampler takes it)."""
    n = positions.shape[0]
    return sampling.sample(logits.float(), torch.full((n,), float(spec["temperature"]), dtype=torch.float32),
                           torch.full((n,), int(spec["top_k"]), dtype=torch.int64),
                           torch.full((n,), float(spec["top_p"]), dtype=torch.float32),
                           torch.full((n,), _signed_seed(spec["seed"]), dtype=torch.int64), positions)


class Scored(NamedTuple):
    """One output position of a rescore, as generation's step would have returned it."""
    drawn: int                 # the token the request's sampling draws there
    token_ids: list[int]       # vLLM's gathered row: the served token, then the top-n
    logprobs: list[float]
    rank: int                  # the served token's rank


_scores: dict[str, dict[int, Scored]] = {}  # tag -> absolute position -> its score (this process)


def score_rescore_rows(runner: Any, hidden_states: torch.Tensor,
                       num_scheduled_tokens: dict[str, int]) -> None:
    """In vLLM's model runner, for this step's requests that carry `RESCORE_KEY`: each output position (from
    `prompt_len` on) that this step's rows predict, scored. Row j of a request is its token at absolute
    position `num_computed_tokens + j`, whose hidden state predicts position + 1 (vLLM's own prompt-logprobs
    indexing)."""
    for req_id, scheduled in num_scheduled_tokens.items():
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        spec = (params.extra_args or {}).get(RESCORE_KEY) if params is not None and scheduled else None
        if not spec or state.prompt_token_ids is None:
            continue
        # the request is prompt + output but its last token: its rows from prompt_len - 1 on predict the
        # output
        start, ids = state.num_computed_tokens, list(state.prompt_token_ids) + [int(spec["last"])]
        first = max(start, int(spec["prompt_len"]) - 1)
        stop = min(start + scheduled, len(ids) - 1)
        if first >= stop:
            continue
        offset = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]]) - start
        # at TP > 1 a collective (the vocab shards all-gathered): every rank runs it for the same requests
        logits = runner.model.compute_logits(hidden_states[offset + first: offset + stop])
        positions = torch.arange(first + 1, stop + 1, dtype=torch.int64)
        drawn = _draw(logits, spec, positions).tolist()
        served = torch.tensor(ids[first + 1: stop + 1], dtype=torch.int64)
        ids, lps, ranks, *_ = runner.sampler.gather_logprobs(runner.sampler.compute_logprobs(logits),
                                                             max(1, int(spec["top_n"])), served)
        rows = zip(positions.tolist(), drawn, ids.tolist(), lps.tolist(), ranks.tolist())
        _scores.setdefault(str(spec["tag"]), {}).update(
            (pos, Scored(d, i, lp, int(r))) for pos, d, i, lp, r in rows)


def take_scores(tag: str) -> dict[int, Scored]:
    """The scores `score_rescore_rows` made for a rescore request (absolute position -> score), forgotten."""
    return _scores.pop(tag, {})


def take_worker_scores(worker: Any, tags: list[str]) -> dict[str, dict[int, Scored]]:
    """`take_scores` for each tag, run in a worker through vLLM's `collective_rpc` (`worker` unused): the
    scores live in the process whose model runner made them (one per rank at tensor-parallel size > 1)."""
    return {tag: take_scores(tag) for tag in tags}


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
