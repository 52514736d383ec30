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


def _host(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a host tensor, pinned when they go to a GPU (so the copy there does not wait)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: Callable[[], list[int]]
          ) -> torch.Tensor:
    """The token each row draws: row-local, seeded by (seed, position) (`positions()`: each row's). All-greedy
    steps take the argmax without building the parameter tensors (what `sample` returns for them). The
    parameters go to the device from pinned host memory, so nothing here waits for the device."""
    dev = logits.device
    if all(p.temperature == 0 for p in params):
        return logits.argmax(dim=-1)
    return sampling_ops.sample(
        logits, _host([p.temperature for p in params], torch.float32, dev),
        _host([p.top_k for p in params], torch.int64, dev),
        _host([p.top_p for p in params], torch.float32, dev),
        _host([p.seed - (1 << 64) if p.seed >= (1 << 63) else p.seed for p in params],
              torch.int64, dev),  # u64 seeds as their two's-complement int64
        _host(positions(), torch.int64, dev))


class Sampled:
    """The tokens, logprobs and top-n alternatives of a step's sampling rows, on their way to the host:
    `into` waits for them (on a GPU: for this step's copy only, not for work queued after it)."""

    def __init__(self, seqs: list[Sequence], logits: torch.Tensor,
                 drawn: Callable[[torch.Tensor], None] | None, positions: list[int]) -> None:
        """Sample row i of `logits` [len(seqs), V] for `seqs[i]`, its new token at `positions[i]`;
        `drawn(tokens)` sees the tokens on the device before they are copied to the host."""
        sp = [s.sampling_params for s in seqs]
        self.seqs = seqs
        tokens = _draw(logits, sp, lambda: positions)
        if drawn is not None:
            drawn(tokens)
        lps = sampling_ops.token_logprobs(logits, tokens)
        n_top = max((p.logprobs or 0) for p in sp)
        top = sampling_ops.top_logprobs(logits, n_top) if n_top else None
        cuda = logits.device.type == "cuda"

        def to_host(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", non_blocking=True) if cuda else t

        self.values = to_host(torch.stack((tokens.to(torch.float64), lps.to(torch.float64))))
        self.top = None if top is None else (to_host(top.ids), to_host(top.logprobs))
        self.event: torch.cuda.Event | None = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def results(self) -> dict[int, SeqResult]:
        """Each sampling row's result, by sequence id (waits as `into` does)."""
        results: dict[int, SeqResult] = {}
        self.into(results)
        return results

    def into(self, results: dict[int, SeqResult]) -> None:
        if self.event is not None:
            self.event.synchronize()
        host_tokens, host_lps = self.values.tolist()
        top_ids, top_lps = ([], []) if self.top is None else (self.top[0].tolist(), self.top[1].tolist())
        for row, (seq, tok, lp) in enumerate(zip(self.seqs, host_tokens, host_lps)):
            r = results[seq.seq_id] = results.get(seq.seq_id) or SeqResult()
            r.token, r.logprob = int(tok), lp
            n = seq.sampling_params.logprobs
            if top_ids and n:
                r.top = list(zip(top_ids[row][:n], top_lps[row][:n]))


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

    @torch.inference_mode()
    def replay(self, step: SchedulerOutput) -> Sampled | None:
        """Queue a decode-only step as a graph replay (the same kernels, the same bits), sampled on the device
        and the sampled tokens written into the rows the next replay reads; None: it runs eagerly. Nothing
        here waits for the device: `Sampled.into` does."""
        if self.graphs is None:
            return None
        seqs, positions = [], []
        for e in step.scheduled:
            if e.num_new_tokens != 1 or not e.samples_token or e.seq.score is not None:
                return None
            seqs.append(e.seq)
            positions.append(e.start_pos)
        replay = self.graphs.run(seqs, positions)
        if replay is None:
            return None
        fed = dict(zip((s.seq_id for s in seqs), positions))
        return Sampled(replay.seqs, replay.logits, self.graphs.rows.advance,
                       [fed[s.seq_id] + 1 for s in replay.seqs])  # each new token's position

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, slots: Callable[[ScheduledSeq], list[int]]
                ) -> dict[int, SeqResult]:
        """Run `step`. `slots(entry)`: cache slots of the chunk's tokens (a replayed decode step computes
        them on the device). A scoring sequence's `score`: the first position whose token is scored (teacher
        forcing) and the sampling parameters the scored tokens were drawn with (so the draw at each row can
        be checked too)."""
        entries = step.scheduled
        sampled = self.replay(step)
        if sampled is not None:
            return sampled.results()
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
        by_id = {e.seq.seq_id: e for e in entries}
        chosen = [by_id[owners[j][0]] for j in sample_idx]
        # each new token at its chunk's end (the chunk reaches the end of the sequence's tokens)
        Sampled([e.seq for e in chosen], logits[sample_idx], None, [e.end_pos for e in chosen]).into(results)
