"""The model runner: lays out one scheduled step, runs the model through the KernelSet, samples.

Every kernel the step launches goes through `kernels` (gemm, attention, moe, row-local ops), whose selectors
see the step's runtime inputs. Logits are computed only for the rows that need them: the last row of each
sequence that samples, and, for a rescoring sequence, every row whose next token is known (teacher forcing).
The LM head is a gemm like any other, so a row's logits do not depend on how many rows are computed with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from detent_audit.engine.model import CausalLM
from detent_audit.engine.scheduler import ScheduledSeq, SchedulerOutput
from detent_audit.engine.sequence import ScoreSpec, Sequence
from detent_audit.engine.tensor_parallel import TensorParallelLM
from detent_audit.kernels import AttentionMetadata, Kernels
from detent_audit.kernels import sampling as sampling_ops
from detent_audit.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from detent_audit.engine.cuda_graphs import DecodeGraphs


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: Callable[[], list[int]]
          ) -> torch.Tensor:
    """The token each row draws: row-local, seeded by (seed, position) (`positions()`: each row's). All-greedy
    steps take the argmax without building the parameter tensors (what `sample` returns for them; no device
    round trips)."""
    dev = logits.device
    if all(p.temperature == 0 for p in params):
        return logits.argmax(dim=-1)
    return sampling_ops.sample(
        logits, torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.seed - (1 << 64) if p.seed >= (1 << 63) else p.seed for p in params],
                     dtype=torch.int64, device=dev),  # u64 seeds as their two's-complement int64
        torch.tensor(positions(), dtype=torch.int64, device=dev))


@dataclass(slots=True)
class SeqResult:
    """One scheduled sequence's step output."""

    token: int | None = None                     # the sampled token (None if the chunk samples nothing)
    logprob: float | None = None                 # fp32 log p(token) under the raw logits
    top: list[tuple[int, float]] | None = None   # top-n (token, logprob), most likely first
    scored: list[float] = field(default_factory=list)  # teacher-forced logprobs of known next tokens
    scored_samples: list[int] = field(default_factory=list)  # what sampling would have drawn at those rows
    # top-n at those rows (score_params)
    scored_tops: list[list[tuple[int, float]]] = field(default_factory=list)


class ModelRunner:
    """Owns the paged KV cache of every layer. `execute` runs one scheduled step."""

    def __init__(self, model: CausalLM | TensorParallelLM, kernels: Kernels, num_blocks: int, block_size: int,
                 device: str = "cpu", graphs: DecodeGraphs | None = None) -> None:
        self.model, self.kernels, self.block_size, self.device = model, kernels, block_size, device
        # kv_caches[layer] = (k, v), each [num_blocks, block_size, kv_heads, head_dim] (a tensor-parallel
        # model: one such pair per rank it holds)
        self.kv_caches = model.new_kv_caches(num_blocks, block_size, device)
        self.graphs = graphs  # DecodeGraphs (GPU) or None: decode-only steps replay a captured graph

    def _graph_step(self, entries: tuple[ScheduledSeq, ...]) -> dict[int, SeqResult] | None:
        """A decode-only step replayed (the same kernels, the same bits), sampled; None: run it eagerly."""
        if self.graphs is None:
            return None
        seqs, positions = [], []
        for e in entries:
            if e.num_new_tokens != 1 or not e.samples_token or e.seq.score is not None:
                return None
            seqs.append(e.seq)
            positions.append(e.start_pos)
        replay = self.graphs.run(seqs, positions)
        if replay is None:
            return None
        results: dict[int, SeqResult] = {}
        self._sample_seqs(replay.seqs, replay.logits, results, self.graphs.rows.advance)
        return results

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, slots: Callable[[ScheduledSeq], list[int]]
                ) -> dict[int, SeqResult]:
        """Run `step`. `slots(entry)`: cache slots of the chunk's tokens (a replayed decode step computes
        them on the device). A scoring sequence's `score`: the first position whose token is scored (teacher
        forcing) and the sampling parameters the scored tokens were drawn with (so the draw at each row can
        be checked too)."""
        entries = step.scheduled
        replayed = self._graph_step(entries)
        if replayed is not None:
            return replayed
        ids: list[int] = []
        positions: list[int] = []
        slot_list: list[int] = []
        cu = [0]
        for e in entries:
            ids += e.seq.token_ids[e.start_pos:e.end_pos]
            positions += range(e.start_pos, e.end_pos)
            slot_list += slots(e)
            cu.append(cu[-1] + e.num_new_tokens)
        max_blocks = max(len(e.seq.block_table) for e in entries)
        tables = torch.tensor([e.seq.block_table + [0] * (max_blocks - len(e.seq.block_table))
                               for e in entries], dtype=torch.int64)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int64),
            context_lens=torch.tensor([e.start_pos for e in entries], dtype=torch.int64),
            seq_lens=torch.tensor([e.end_pos for e in entries], dtype=torch.int64),
            block_tables=tables, slot_mapping=torch.tensor(slot_list, dtype=torch.int64).to(self.device),
            max_seqlen_q=max(e.num_new_tokens for e in entries), max_seqlen_k=max(e.end_pos for e in entries))
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device),
                            torch.tensor(positions, dtype=torch.int64, device=self.device), meta,
                            self.kv_caches, self.kernels)  # [T, H]

        rows: list[int] = []          # hidden rows whose logits are needed
        owners: list[tuple[int, str]] = []  # each row's sequence and what it is for: "score" or "sample"
        targets: list[int] = []       # the known next token of each "score" row, in row order
        specs: list[ScoreSpec] = []   # the score of each "score" row's sequence
        for i, e in enumerate(entries):
            sid, spec = e.seq.seq_id, e.seq.score
            if spec is not None:
                first = spec.first - 1
                for p in range(max(e.start_pos, first), min(e.end_pos, first + len(spec.targets))):
                    rows.append(cu[i] + p - e.start_pos)
                    targets.append(spec.targets[p + 1 - spec.first])
                    specs.append(spec)
                    owners.append((sid, "score"))
            if e.samples_token:
                rows.append(cu[i + 1] - 1)
                owners.append((sid, "sample"))
        results = {e.seq.seq_id: SeqResult() for e in entries}
        if not rows:
            return results
        logits = self.model.compute_logits(hidden[rows], self.kernels)  # [R, V] fp32
        sample_idx = [j for j, (_, kind) in enumerate(owners) if kind == "sample"]
        score_idx = [j for j, (_, kind) in enumerate(owners) if kind == "score"]
        if score_idx:
            sub = logits[score_idx]
            scored = sampling_ops.token_logprobs(sub, torch.tensor(targets, device=sub.device))
            draws = _draw(sub, [s.params for s in specs], lambda: [positions[rows[j]] + 1 for j in score_idx])
            for j, lp, tok in zip(score_idx, scored.tolist(), draws.tolist()):
                results[owners[j][0]].scored.append(lp)
                results[owners[j][0]].scored_samples.append(tok)
            n_top = max((s.params.logprobs or 0) for s in specs)
            if n_top:  # the alternatives a response returned at each position, from the same logits
                top = sampling_ops.top_logprobs(sub, n_top)
                for row, (j, spec) in enumerate(zip(score_idx, specs)):
                    n = spec.params.logprobs or 0
                    results[owners[j][0]].scored_tops.append(
                        list(zip(top.ids[row, :n].tolist(), top.logprobs[row, :n].tolist())))
        if sample_idx:
            self._sample(entries, owners, sample_idx, logits, results)
        return results

    def _sample(self, entries, owners, sample_idx, logits, results) -> None:
        by_id = {e.seq.seq_id: e.seq for e in entries}
        self._sample_seqs([by_id[owners[j][0]] for j in sample_idx], logits[sample_idx], results)

    @staticmethod
    def _sample_seqs(seqs: list[Sequence], logits: torch.Tensor, results: dict[int, SeqResult],
                     drawn: Callable[[torch.Tensor], None] | None = None) -> None:
        """Sample row i of `logits` [len(seqs), V] for `seqs[i]` into `results`; `drawn(tokens)` sees the
        tokens on the device before they are copied to the host (once, with their logprobs)."""
        sp = [s.sampling_params for s in seqs]
        tokens = _draw(logits, sp, lambda: [s.num_tokens for s in seqs])  # at the new token's position
        if drawn is not None:
            drawn(tokens)
        lps = sampling_ops.token_logprobs(logits, tokens)
        n_top = max((p.logprobs or 0) for p in sp)
        top = sampling_ops.top_logprobs(logits, n_top) if n_top else None
        host_tokens, host_lps = torch.stack((tokens.to(torch.float64), lps.to(torch.float64))).tolist()
        for row, (seq, tok, lp) in enumerate(zip(seqs, host_tokens, host_lps)):
            r = results[seq.seq_id] = results.get(seq.seq_id) or SeqResult()
            r.token, r.logprob = int(tok), lp
            if top is not None and seq.sampling_params.logprobs:
                n = seq.sampling_params.logprobs
                r.top = list(zip(top.ids[row, :n].tolist(), top.logprobs[row, :n].tolist()))
