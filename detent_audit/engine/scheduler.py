"""Continuous batching with chunked prefill and preemption by recompute.

Each step, `schedule()` picks what the runner computes under a token budget, in this order:
1. running sequences with one token left to feed (decodes), by arrival;
2. running sequences with more left (continuing chunked prefills, recomputes), by arrival;
3. new admissions from the front of the waiting queue, while the batch has room and blocks suffice
   (none in a step that preempted: memory is short).
A scheduled sequence computes `num_new_tokens` tokens from `start_pos`; when the chunk reaches the end of its
tokens the runner samples one token for it. Prefill and decode are the same operation, so a preempted
sequence recomputes its prompt and outputs as one long prefill and samples its next token from there.

Admission allocates blocks for all of a sequence's tokens (reusing its cached prefix), so prefill chunks never
need new blocks; a decode that crosses a block boundary may. When blocks run out, the most recently arrived
running sequence is preempted: its blocks are freed (cached ones stay reusable), `num_computed_tokens` goes
back to 0, its outputs are kept, and it goes to the front of the waiting queue. The oldest running sequence
is never preempted for a younger one and always fits alone (checked at `add`), so every request finishes.

A decode-only step may be followed by one scheduled ahead (`schedule_ahead`), before its tokens are known,
so that the device computes it while the host records the first: the same sequences feed one more token
each, on the assumption that none finishes. One that does (an end-of-sequence token, a stop string) has its
step ahead discarded at `update`; one that must finish (max_tokens, max_model_len) is left out. It is taken
only when nothing waits and no block is short, so it never delays an admission nor preempts.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from detent_audit.engine.block_manager import BlockManager
from detent_audit.engine.sequence import Sequence, SequenceStatus
from detent_audit.errors import BadInput
from detent_audit.runtime.finish import FinishReason, finish_cause
from detent_audit.runtime.sampling_params import check_token_id, is_int
from detent_audit.runtime.stop_strings import find_stop


def _arrival(seq: Sequence) -> int:
    """When `add` took the sequence (every sequence the scheduler holds has one)."""
    assert seq.arrival is not None, f"sequence {seq.seq_id} was never added"
    return seq.arrival


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_batched_tokens: tokens computed per step at most (the budget); max_prefill_chunk: tokens one
    sequence computes per step at most (None = the budget); max_model_len: prompt plus output tokens at most;
    eos_token_ids: the model's end-of-sequence tokens (finish with 'stop' unless `ignore_eos`)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    prefix_caching: bool = True     # off: no sequence reuses another's KV blocks

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise BadInput(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise BadInput("max_model_len must be >= 2 (one prompt and one output token), got "
                           f"{self.max_model_len}")
        chunk = self.max_prefill_chunk
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise BadInput(f"max_prefill_chunk must be None or an integer >= 1, got {chunk!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise BadInput(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), or running decodes could not all be scheduled in one step",
                remedy="raise max_num_batched_tokens or lower max_num_seqs",
            )
        eos = self.eos_token_ids
        if not isinstance(eos, tuple) or not all(is_int(t) and t >= 0 for t in eos):
            raise BadInput(f"eos_token_ids must be a tuple of token ids, got {self.eos_token_ids!r}")

    @cached_property
    def chunk_size(self) -> int:
        """Tokens one sequence may compute in one step."""
        if self.max_prefill_chunk is None:
            return self.max_num_batched_tokens
        return min(self.max_prefill_chunk, self.max_num_batched_tokens)


class ScheduledSeq(NamedTuple):
    """Compute tokens [start_pos, start_pos + num_new_tokens) of `seq`; sample one token after them iff
    `samples_token` (the chunk reaches the end of the sequence's tokens)."""

    seq: Sequence
    start_pos: int
    num_new_tokens: int
    samples_token: bool

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's batch, in the order the runner lays it out, and the sequences preempted to make room."""

    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(entry.num_new_tokens for entry in self.scheduled)


class Scheduler:
    """Owns the waiting queue, the running set and the block manager. Call `schedule()`, run the model on its
    output, then `update()` with the sampled tokens, strictly alternating; `add()` may come at any time."""

    def __init__(self, config: SchedulerConfig,
                 decode: Callable[[SequenceOf[int]], str] | None = None) -> None:
        self.config = config
        self.decode = decode  # output ids -> text, for stop strings (a request with stop strings needs it)
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          prefix_caching=config.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._next_arrival = 0
        self._live_ids: set[int] = set()
        self._pending: list[SchedulerOutput] = []  # scheduled, not yet updated: at most two (one ahead)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises `BadInput` if it could never run: its prompt leaves no room for an
        output token within `max_model_len`, or at its longest it needs more KV blocks than exist."""
        cfg = self.config
        if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.arrival is not None:
            raise ValueError(f"seq {seq.seq_id}: only a new sequence can be added, got {seq!r}")
        if seq.seq_id in self._live_ids:
            raise ValueError(f"seq {seq.seq_id}: a live sequence already has this id")
        if seq.num_prompt_tokens >= cfg.max_model_len:
            raise BadInput(
                f"request {seq.request_id}: prompt of {seq.num_prompt_tokens} tokens leaves no room for "
                f"output within max_model_len {cfg.max_model_len}",
                remedy=f"shorten the prompt to at most {cfg.max_model_len - 1} tokens",
            )
        # The KV of every token but the last sampled one is needed at most.
        max_len = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, cfg.max_model_len)
        blocks_needed = self.block_manager.num_blocks_for(max_len - 1)
        if blocks_needed > cfg.num_blocks:
            raise BadInput(
                f"request {seq.request_id}: {seq.num_prompt_tokens} prompt tokens + max_tokens "
                f"{seq.sampling_params.max_tokens} need up to {blocks_needed} KV blocks of {cfg.block_size} "
                f"tokens, but the cache has {cfg.num_blocks}",
                remedy="shorten the prompt, lower max_tokens, or give the KV cache more memory",
            )
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self._live_ids.add(seq.seq_id)
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch (see the module docstring). Mutates block tables, the running set and the
        waiting queue; `num_computed_tokens` advances only in `update`."""
        if self._pending:
            raise RuntimeError("schedule() called again before update() of the previous step")
        cfg, blocks = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}  # seq_id -> entry; insertion order is batch order
        preempted: list[Sequence] = []

        # (1, 2): running decodes, then continuing prefills, each by arrival (`running` is kept by arrival)
        running = self.running
        decodes = [s for s in running if len(s.token_ids) - s.num_computed_tokens == 1]
        order = decodes if len(decodes) == len(running) else decodes + [  # a copy: preemption mutates running
            s for s in running if len(s.token_ids) - s.num_computed_tokens > 1]
        block_size = cfg.block_size
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget, cfg.chunk_size)
            end = seq.num_computed_tokens + num_new
            if end <= len(seq.block_table) * block_size:  # its blocks hold the chunk already (most decodes)
                scheduled[seq.seq_id] = ScheduledSeq(seq, end - num_new, num_new, end == len(seq.token_ids))
                budget -= num_new
                continue
            while not blocks.can_append(seq, num_new):
                victim = max(self.running, key=_arrival)
                entry = scheduled.pop(victim.seq_id, None)
                if entry is not None:
                    budget += entry.num_new_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                blocks.append_slots(seq, num_new)
                scheduled[seq.seq_id] = self._entry(seq, num_new)
                budget -= num_new

        # (3): admissions, first come first served
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            blocks.allocate(seq)
            num_new = min(seq.num_uncomputed_tokens, budget, cfg.chunk_size)
            blocks.append_slots(seq, num_new)  # covered by allocate: takes no block
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)  # a preempted sequence comes back in its place
            scheduled[seq.seq_id] = self._entry(seq, num_new)
            budget -= num_new

        out = SchedulerOutput(tuple(scheduled.values()), tuple(preempted))
        self._pending.append(out)
        return out

    def schedule_ahead(self, output: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `output` (scheduled, not yet updated), chosen before its tokens are known: each of
        its sequences feeds the token `output` samples for it, at the next position. None (nothing
        scheduled) unless `output` is all decodes, nothing waits, and the blocks the new positions need are
        free. A sequence that `output` finishes by its length is left out; one it finishes by its token is
        dropped from the step at `update`."""
        if len(self._pending) != 1 or self._pending[0] is not output or self.waiting or not output.scheduled:
            return None
        cfg, blocks = self.config, self.block_manager
        ahead: list[ScheduledSeq] = []
        for e in output.scheduled:
            seq = e.seq
            if e.num_new_tokens != 1 or not e.samples_token or seq.score is not None:
                return None
            if seq.status is not SequenceStatus.RUNNING:  # finished by the token of the step before
                continue
            outputs, length = seq.num_output_tokens + 1, seq.num_tokens + 1  # after `output`'s token
            if outputs >= seq.sampling_params.max_tokens or length >= cfg.max_model_len:
                continue
            ahead.append(ScheduledSeq(seq, e.end_pos, 1, True))
        needed = sum(blocks.num_blocks_for(e.end_pos + 1) - len(e.seq.block_table) for e in ahead)
        if not ahead or needed > blocks.num_available_blocks:
            return None
        for e in ahead:
            blocks.grow(e.seq, e.end_pos + 1)
        out = SchedulerOutput(tuple(ahead), ())
        self._pending.append(out)
        return out

    def update(
        self,
        output: SchedulerOutput,
        sampled_tokens: Mapping[int, int | None],
        logprobs: Mapping[int, float] | None = None,
    ) -> list[Sequence]:
        """Record a computed step: advance `num_computed_tokens`, register full blocks in the prefix cache,
        append sampled tokens (and logprobs, keyed by seq_id for the sampling sequences, if given) and finish
        sequences, freeing their blocks. `sampled_tokens` maps every scheduled seq_id to its token, or to
        None where the chunk samples nothing. Returns the sequences finished in this step, in batch order."""
        if not self._pending or output is not self._pending[0]:
            raise RuntimeError("update() must receive the output of the oldest schedule() not updated")
        entries = output.scheduled  # seq_ids unique: the keys match iff as many and each entry's is there
        if len(sampled_tokens) != len(entries) or any(e.seq.seq_id not in sampled_tokens for e in entries):
            expected = sorted(entry.seq.seq_id for entry in entries)
            raise ValueError(f"sampled_tokens has keys {sorted(sampled_tokens)}, expected {expected}")
        if logprobs is not None and (
                len(logprobs) != sum(e.samples_token for e in entries)
                or any(e.seq.seq_id not in logprobs for e in entries if e.samples_token)):
            sampling = sorted(entry.seq.seq_id for entry in entries if entry.samples_token)
            raise ValueError(f"logprobs has keys {sorted(logprobs)}, expected the sampling seqs {sampling}")
        for entry in output.scheduled:  # validate everything before mutating anything
            token = sampled_tokens[entry.seq.seq_id]
            if entry.samples_token != (token is not None):
                raise ValueError(
                    f"seq {entry.seq.seq_id}: chunk [{entry.start_pos}, {entry.end_pos}) of "
                    f"{entry.seq.num_tokens} tokens "
                    f"{'samples a' if entry.samples_token else 'samples no'} token, got {token!r}"
                )
            if token is not None:
                check_token_id(token, "sampled tokens")
        self._pending.pop(0)
        finished: list[Sequence] = []
        size = self.config.block_size
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:  # scheduled ahead, then finished by its last token
                continue
            seq.num_computed_tokens = entry.end_pos
            if entry.end_pos // size > entry.start_pos // size:  # a block filled (else none to register)
                self.block_manager.commit_full_blocks(seq)
            token = sampled_tokens[seq.seq_id]
            if token is None:
                continue
            seq.append_token(token, None if logprobs is None else logprobs[seq.seq_id])
            reason = self._finish_reason(seq)
            if reason is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                self.block_manager.free(seq)
                self.running.remove(seq)
                self._live_ids.discard(seq.seq_id)
                finished.append(seq)
        return finished

    def abort(self, seq: Sequence) -> None:
        """Drop a live sequence between steps (its client left): out of the queues, its blocks freed (cached
        ones stay in the prefix cache), its status FINISHED with no finish reason. It is never returned as
        finished."""
        if self._pending:
            raise RuntimeError("abort() between schedule() and update()")
        if seq.seq_id not in self._live_ids:
            raise ValueError(f"seq {seq.seq_id} is not live")
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)  # waiting or preempted: it holds no blocks
        self._live_ids.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(
            seq=seq,
            start_pos=seq.num_computed_tokens,
            num_new_tokens=num_new,
            samples_token=seq.num_computed_tokens + num_new == seq.num_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        """The finish rule (runtime/finish.py) after `seq`'s last token; None while it goes on."""
        params = seq.sampling_params
        stop_string = False
        if params.stop:  # checked after every token, so the first token whose text holds one stops it
            if self.decode is None:
                raise RuntimeError("a request with stop strings needs a scheduler with a decode function")
            stop_string = find_stop(self.decode(seq.output_token_ids), params.stop) is not None
        tokens = seq.token_ids  # (the properties last_token_id, num_output_tokens, num_tokens, read once)
        cause = finish_cause(tokens[-1], len(tokens) - len(seq.prompt_token_ids), len(tokens), params,
                             self.config.eos_token_ids, self.config.max_model_len, stop_string=stop_string)
        return None if cause is None else cause.reason
