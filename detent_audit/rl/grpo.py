"""TRL's GRPO with the detent engine on both sides: rollouts generated in process by `LLM`, the trainer's
logprobs carrying the engine's bits (`scorer.py`), the parity gate before every backward.

`DetentGRPOTrainer` subclasses `trl.GRPOTrainer` through its own hooks, nothing forked:
- `rollout_func` (TRL's custom generation hook): the trainer model's weights are loaded into the engine when
  the optimizer stepped since the last rollout (`LLM.load_weights`: the facts name the new digest), then every
  sample is drawn with its own seed (a hash of the run seed, the step and the sample's index: n > 1 samples
  of one prompt never share one); the seeds are kept in `rollout_seeds` and passed to reward functions.
- `_get_per_token_logps_and_entropies` (TRL's per-token scorer): transformers' forward (TRL's own, fused head
  and all) gives the gradient, the engine's teacher-forced rescore the values (`serving_values`).
- `_generate_and_score_completions`: the old-policy logprobs are the scorer's, gated bit for bit against the
  rollout's (`gate.py`; fail closed unless `gate=ParityGate(fail=False)`), and set as TRL's
  `old_per_token_logps`, so the policy ratio is exactly 1 on policy and no importance-sampling correction is
  needed. Beside it, TRL's stock scorer (transformers' forward alone) over the same generations: its bit
  mismatch and the importance-sampling ratio TRL would apply (min, mean, max), logged per step in `step_log`.
The engine rescores each generation once, for the gate; the loss's forward within the same optimizer step (the
same weights) reuses those gated values. Timings per step: TRL's own forward (`stock_scorer_s`), the engine
rescore the detent scorer adds (`exact_scorer_s`), the stock comparison (`comparison_s`, measurement only),
the whole step (`step_s`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from trl import GRPOTrainer

from detent_audit.engine.llm import LLM
from detent_audit.manifests.receipt import ClientRequest
from detent_audit.rl.gate import ParityGate, compare
from detent_audit.rl.scorer import exact_logprobs, serving_values
from detent_audit.runtime.sampling_params import SamplingParams

ROLLOUT_API = "detent/v1/offline-jsonl"  # a signed rollout's request: the body `serve --input` reads


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """A 63-bit seed for sample `index` of optimizer step `step`: distinct samples get distinct seeds."""
    digest = hashlib.sha256(f"{run_seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def completion_pairs(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
                     ) -> list[tuple[list[int], list[int]]]:
    """TRL's batch (left-padded prompts, right-padded completions of width `logits_to_keep`) as
    (prompt ids, completion ids) pairs without the padding."""
    pairs = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        cut = len(ids) - logits_to_keep
        prompt = [t for t, m in zip(ids[:cut], mask[:cut]) if m]
        completion = [t for t, m in zip(ids[cut:], mask[cut:]) if m]
        pairs.append((prompt, completion))
    return pairs


class DetentGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose rollouts come from `llm` and whose logprobs carry its bits (see the module doc).
    `llm` must be built from the same checkpoint as the trainer's model, in fp32 (the trainer's dtype)."""

    def __init__(self, *args: Any, llm: LLM, run_seed: int = 0, gate: ParityGate | None = None,
                 node: Any = None, **kwargs: Any) -> None:
        """`node`: a `detent_audit.server.node.ServingNode` over `llm`; given, every rollout is signed (its
        receipt names its seed and the policy's weights digest) as `rollout-<step>-<sample>`."""
        self.llm, self.run_seed, self.gate, self.node = llm, run_seed, gate or ParityGate(), node
        self.rollout_seeds: list[list[int]] = []   # per generation: each sample's seed
        self.step_log: list[dict[str, float]] = []  # per generation: parity, stock comparison, timings
        self.weights_digests: list[str] = []        # per generation: the policy the rollouts name
        self._loaded_step = -1
        self._gated: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}  # gated exact values
        self._gated_step = -1                       # the optimizer step (weights) they were gated at
        self._exact_s = self._stock_s = 0.0
        kwargs["rollout_func"] = self._rollout
        super().__init__(*args, **kwargs)

    # ---- rollouts
    def _sync_weights(self) -> None:
        if self.state.global_step != self._loaded_step:
            model = self.accelerator.unwrap_model(self.model)
            self.weights_digests.append(self.llm.load_weights(model.state_dict()))
            self._loaded_step = self.state.global_step
        else:
            self.weights_digests.append(self.weights_digests[-1])

    def _rollout(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, Any]:
        self._sync_weights()
        tok = self.processing_class
        prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else p,
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
                      for p in prompts]
        step = self.state.global_step
        seeds = [sample_seed(self.run_seed, step, i) for i in range(len(prompts))]
        args = self.args
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=s,
                                 max_tokens=args.max_completion_length) for s in seeds]
        outs = self.llm.generate([list(p) for p in prompt_ids], params)
        if self.node is not None:
            for i, (out, p) in enumerate(zip(outs, params)):
                body = {"prompt_token_ids": list(out.prompt_token_ids), "max_tokens": p.max_tokens,
                        "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed}
                self.node.sign(out, p, f"rollout-{step}-{i}", ClientRequest.of(ROLLOUT_API, body))
        self.rollout_seeds.append(seeds)
        return {"prompt_ids": [list(o.prompt_token_ids) for o in outs],
                "completion_ids": [list(o.token_ids) for o in outs],
                "logprobs": [list(o.logprobs) for o in outs], "rollout_seed": seeds}

    # ---- scoring
    def _stock_logps(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     logits_to_keep: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        start = time.perf_counter()
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                         **kwargs)
        self._stock_s += time.perf_counter() - start
        return out

    def _exact(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
               like: torch.Tensor) -> torch.Tensor:
        """The engine's bits at every completion token, TRL's layout ([B, logits_to_keep], `like`'s values
        at padding). Within the optimizer step that gated them (the same weights), a pair's values are the
        gated ones (what the rescore would give again: the gate just compared them bit for bit with the
        rollout's); any other pair is rescored."""
        start = time.perf_counter()
        pairs = completion_pairs(input_ids, attention_mask, logits_to_keep)
        known = self._gated if self._gated_step == self.state.global_step else {}
        missing = [pair for pair in pairs if _key(pair) not in known]
        fresh = {_key(pair): v for pair, v in zip(missing, exact_logprobs(self.llm, missing))}
        exact = like.detach().clone()
        for row, pair in enumerate(pairs):
            key = _key(pair)
            values = known[key] if key in known else fresh[key]
            exact[row, :len(values)] = values.to(exact.device, exact.dtype)
        self._exact_s += time.perf_counter() - start
        return exact

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           *args: Any, **kwargs: Any
                                           ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        logps, entropies, aux = self._stock_logps(model, input_ids, attention_mask, logits_to_keep,
                                                  *args, **kwargs)
        exact = self._exact(input_ids, attention_mask, logits_to_keep, logps)
        return serving_values(logps, exact), entropies, aux

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        begin_exact = self._exact_s
        output = super()._generate_and_score_completions(inputs)
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        width, mask = output["completion_ids"].size(1), output["completion_mask"].bool()
        rollout = output["sampling_per_token_logps"]
        with torch.no_grad():
            # the detent scorer: the old-policy logprobs, gated against the rollout's before any backward
            old = self._exact(input_ids, attention_mask, width, rollout)
            report = self.gate.check(_rows(rollout, mask), _rows(old, mask))
            output["old_per_token_logps"] = old
            pairs = completion_pairs(input_ids, attention_mask, width)
            self._gated = {_key(pair): row for pair, row in zip(pairs, _rows(old, mask))}
            self._gated_step = self.state.global_step
            # TRL's stock scorer over the same generations, for comparison (not used by the loss)
            compare_s = time.perf_counter()
            stock, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                self, self.model, input_ids, attention_mask, width)
            compare_s = time.perf_counter() - compare_s
        stock_report = compare(_rows(rollout, mask), _rows(stock, mask))
        ratio = torch.exp(stock.double() - rollout.double())[mask]
        self.step_log.append({
            "step": float(self.state.global_step), "tokens": float(report.tokens), **report.metrics(),
            "stock_logprob_bit_mismatch": stock_report.metrics()["logprob_bit_mismatch"],
            "stock_logprob_bit_mismatch_tokens": float(stock_report.mismatched),
            "stock_train_rollout_logprob_abs_diff": stock_report.abs_diff_mean,
            "stock_train_rollout_logprob_abs_diff_max": stock_report.abs_diff_max,
            "stock_importance_ratio_min": float(ratio.min()),
            "stock_importance_ratio_mean": float(ratio.mean()),
            "stock_importance_ratio_max": float(ratio.max()),
            "comparison_s": compare_s, "gate_exact_s": self._exact_s - begin_exact})
        for name, value in report.metrics().items():
            self._metrics["train"][f"detent/{name}"].append(value)
        return output

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        begin_exact, begin_stock = self._exact_s, self._stock_s
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.step_log:
            entry = self.step_log[-1]
            entry["step_s"] = entry.get("step_s", 0.0) + time.perf_counter() - start
            entry["exact_scorer_s"] = entry.get("exact_scorer_s", 0.0) + self._exact_s - begin_exact
            entry["stock_scorer_s"] = entry.get("stock_scorer_s", 0.0) + self._stock_s - begin_stock
        return loss


def _key(pair: tuple[list[int], list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(pair[0]), tuple(pair[1])


def _rows(values: torch.Tensor, mask: torch.Tensor) -> Sequence[torch.Tensor]:
    return [v[m] for v, m in zip(values, mask)]
