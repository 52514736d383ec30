"""One request's state as it moves through the engine: tokens, KV progress, blocks and outputs.

Life of a sequence: WAITING (added) -> RUNNING (admitted: blocks allocated) -> FINISHED, with possible
detours RUNNING -> PREEMPTED (blocks freed, back at the front of the waiting queue) -> RUNNING.

Invariants (kept by the scheduler and the block manager, checked by `BlockManager.check_integrity`):
- `token_ids` is the prompt followed by the output tokens; `num_tokens = len(token_ids)`.
- `0 <= num_cached_tokens <= num_computed_tokens <= num_tokens`: tokens [0, num_computed_tokens) have their
  KV in the cache; while RUNNING, `num_computed_tokens < num_tokens` (the last token still has to be fed).
- `block_table[i]` is the physical block holding positions [i * block_size, (i + 1) * block_size).
- `output_logprobs[i]` is the runner's fp32 logprob of output token i, when the runner reports logprobs;
  `top_logprobs[i]` its top-n alternatives, when the request asks for them.
- a scoring sequence (`score`: rescore's teacher forcing, or an echo's prompt) holds in `scored` one entry per
  target scored so far; a prefix-cache hit never covers the positions it scores (`cache_hit_limit`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TypeVar

from detent_audit.errors import BadInput
from detent_audit.runtime.contract import Rescored, TopLogprobs
from detent_audit.runtime.finish import FinishReason
from detent_audit.runtime.sampling_params import SamplingParams, check_token_id, is_int

T = TypeVar("T")


@dataclass(frozen=True)
class ScoreSpec:
    """A rescoring sequence: score `targets`, the tokens at positions `first`, `first + 1`, ...; they were
    drawn with `params`. The sequence holds the prompt and every target but the last (the last one's logits
    are those of the position before it), so a response that filled the context is rescored within it; or,
    for a served prompt's logprobs (echo), the prompt, every token of it from `first` on a target, and samples
    after it."""

    first: int
    params: SamplingParams
    targets: tuple[int, ...]


def _replace_from(kept: list[T], keep: int, new: Iterable[T]) -> None:
    """`kept` cut to its first `keep` items, then `new` appended."""
    del kept[keep:]
    kept.extend(new)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Sequence:
    """A request being served. The scheduler and block manager mutate it; the runner reads it.

    `seq_id` is the engine's key for the sequence (unique among live sequences); `request_id` is the
    user-facing id recorded in receipts (defaults to `str(seq_id)`). `arrival` is set by `Scheduler.add`
    and orders sequences for scheduling and preemption.
    """

    __slots__ = (
        "seq_id", "request_id", "prompt_token_ids", "token_ids", "sampling_params", "status", "finish_reason",
        "num_computed_tokens", "num_cached_tokens", "block_table", "output_logprobs", "arrival",
        "num_preemptions", "score", "scored", "top_logprobs",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        *,
        request_id: str | None = None,
        score: ScoreSpec | None = None,
    ) -> None:
        if not is_int(seq_id) or seq_id < 0:
            raise BadInput(f"seq_id must be an integer >= 0, got {seq_id!r}")
        if len(prompt_token_ids) == 0:
            raise BadInput(
                f"request {request_id or seq_id}: the prompt is empty",
                remedy="pass at least one prompt token (e.g. the tokenizer's BOS token)",
            )
        if not isinstance(sampling_params, SamplingParams):
            raise BadInput(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.seq_id = seq_id
        self.request_id = str(seq_id) if request_id is None else request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(
            check_token_id(t, "prompt_token_ids") for t in prompt_token_ids
        )
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.output_logprobs: list[float] = []
        self.arrival: int | None = None
        self.num_preemptions = 0
        self.score = score
        self.scored: Rescored | None = None if score is None else Rescored([], [], [])
        self.top_logprobs: TopLogprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def cache_hit_limit(self) -> int:
        """Tokens a prefix-cache hit may cover: never the last (its logits are needed), and for a scoring
        sequence none whose logits score a target."""
        limit = self.num_tokens - 1
        return limit if self.score is None else min(limit, max(0, self.score.first - 1))

    def record_scores(self, start_pos: int, logprobs: list[float], draws: list[int],
                      tops: TopLogprobs) -> None:
        """A step's scores of this scoring sequence, its chunk starting at `start_pos`: a recompute after
        preemption scores its rows again, and each position keeps its score once."""
        if self.score is None or self.scored is None:
            raise ValueError(f"seq {self.seq_id} scores nothing")
        keep = max(0, start_pos - (self.score.first - 1))
        _replace_from(self.scored.logprobs, keep, logprobs)
        _replace_from(self.scored.tokens, keep, draws)
        _replace_from(self.scored.tops, keep, tops)

    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        """Append one sampled token (and its logprob, when the runner computed one)."""
        self.token_ids.append(check_token_id(token_id, "sampled tokens"))
        if logprob is not None:
            self.output_logprobs.append(float(logprob))

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"cached={self.num_cached_tokens}, blocks={self.block_table})"
        )
