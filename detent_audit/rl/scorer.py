"""The trainer's scorer: per-token logprobs whose values are the rollout engine's bits and whose gradients
are a differentiable forward's.

Design. Two forwards over the same parameters:
1. exact: the engine's own teacher-forced rescore (`LLM.rescore_batch`: the runner, the committed tuple's
   KernelSet, the serving log-softmax) under no grad. Batch invariance makes its values those `LLM.generate`
   returned for the same tokens, whatever the batching, padding, order or micro-batch on either side.
2. differentiable: `forward.token_scores` (plain torch ops, any kernels), or any callable the trainer brings
   (its own module's forward, e.g. transformers').
Each token's output is `exact` in the forward and `differentiable`'s gradient in the backward
(`serving_values`, an autograd function: no arithmetic touches the exact value, so even -0.0 survives). The
values are therefore bit-identical to the rollout's; the gradient is that of a forward whose values differ
from the exact ones by the kernels' rounding: on SmolLM2-135M in fp32, logprobs within 1e-4 absolute, and
gradients within a relative 1e-3 of transformers' (tests/rl/test_scorer.py measures both).
Entropy, if asked, is the differentiable forward's (its logits; the serving path returns no full rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import FunctionCtx

from detent_audit.engine.llm import LLM
from detent_audit.engine.model import CausalLM
from detent_audit.errors import BadInput
from detent_audit.rl.forward import Pair, TokenScores, token_scores

Differentiable = Callable[[Sequence[Pair], bool], TokenScores]


class _ServingValues(torch.autograd.Function):
    """forward(diff, exact) = exact; backward passes the gradient to `diff` unchanged."""

    @staticmethod
    def forward(ctx: FunctionCtx, diff: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact.to(diff.dtype).clone()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def serving_values(diff: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`exact`'s values with `diff`'s gradient (same shape; `exact` cast to `diff`'s dtype, exactly for fp32
    into fp32 or wider)."""
    if diff.shape != exact.shape:
        raise ValueError(f"differentiable logprobs {tuple(diff.shape)} for {tuple(exact.shape)} exact ones")
    return _ServingValues.apply(diff, exact.detach())


def exact_logprobs(llm: LLM, pairs: Sequence[Pair]) -> list[torch.Tensor]:
    """The serving kernels' fp32 logprob of every completion token (the engine's teacher-forced rescore)."""
    if not pairs:
        return []
    scored = llm.rescore_batch([(list(p), list(c)) for p, c in pairs])
    return [torch.tensor(s.logprobs, dtype=torch.float32) for s in scored]


class Scorer:
    """Scores (prompt ids, completion ids) pairs for a trainer: `score` returns serving-bit values with
    gradients. `llm` is the rollout engine (or one with the same facts). `differentiable` defaults to the
    plain-torch forward of `policy` (default `llm.model`), whose parameters are then made trainable
    (`requires_grad`): an optimizer stepping the engine's own model changes its weights in place (call
    `llm.load_weights({})` before the next rollout so the facts name the new weights).

    Rollouts served at TP=N: score with an engine of `tensor_parallel_size` N and `tensor_parallel_ranks`
    "emulated" (every rank's shard in this one process, the partial sums added in rank order: the TP=N bits,
    docs/design.md section 5) and pass the full model as `policy` for the gradients."""

    def __init__(self, llm: LLM, differentiable: Differentiable | None = None,
                 policy: CausalLM | None = None) -> None:
        self.llm = llm
        if differentiable is None:
            model = policy if policy is not None else llm.model
            if not isinstance(model, CausalLM):
                raise BadInput("the default differentiable forward needs the full model (a CausalLM)",
                               remedy="pass `policy` (the full model) or `differentiable`")
            for p in model.parameters():
                p.requires_grad_(True)
            self.differentiable: Differentiable = lambda pairs, entropy: token_scores(model, pairs,
                                                                                     entropy=entropy)
        else:
            self.differentiable = differentiable

    def score(self, pairs: Sequence[Pair], *, micro_batch: int | None = None,
              entropy: bool = False) -> TokenScores:
        """Per pair: the completion's logprobs [n] (the rollout engine's fp32 bits, gradients of the
        differentiable forward) and, with `entropy`, each position's entropy. `micro_batch`: pairs per forward
        (None: all at once); the values do not depend on it."""
        if micro_batch is not None and micro_batch < 1:
            raise BadInput(f"micro_batch must be >= 1, got {micro_batch}")
        step = micro_batch or max(1, len(pairs))
        logprobs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        for start in range(0, len(pairs), step):
            chunk = pairs[start:start + step]
            exact = exact_logprobs(self.llm, chunk)
            diff = self.differentiable(chunk, entropy)
            logprobs += [serving_values(d, e.to(d.device)) for d, e in zip(diff.logprobs, exact)]
            if entropy and diff.entropies is not None:
                entropies += diff.entropies
        return TokenScores(logprobs, entropies if entropy else None)
