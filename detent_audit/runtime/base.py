"""What every engine behind the boundary (`detent_audit.runtime.contract.Engine`) shares, written once: a finished
request's `RequestOutput`, and `EngineBase` (the thread count and mode its config fixes, `run` and `generate`
over its own `add_request`/`step`). The embedded engine, vLLM's and SGLang's derive from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from detent_audit.runtime import contract as engine_api
from detent_audit.runtime.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]                                   # fp32 values, one per output token
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_cached_tokens: int = 0
    # echo: the fp32 logprob of every prompt token after the first, and their top-n (None: not asked)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


class EngineSettings(Protocol):
    """The part of an engine's config the base reads."""

    @property
    def mode(self) -> str: ...

    @property
    def num_threads(self) -> int: ...


Handle = TypeVar("Handle", bound=engine_api.RequestHandleLike)


class EngineBase(ABC, Generic[Handle]):
    """An engine's requests are `Handle`s; `config` fixes its mode and thread count."""

    name: str
    config: EngineSettings

    @property
    def num_threads(self) -> int:
        return self.config.num_threads

    @property
    def mode(self) -> str:
        return self.config.mode

    @abstractmethod
    def add_request(self, prompt: str | SequenceOf[int], params: SamplingParams,
                    request_id: str | None = None) -> Handle: ...

    @abstractmethod
    def step(self) -> list[Handle]: ...

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def output_of(self, seq: Handle) -> RequestOutput: ...

    def run(self, seqs: SequenceOf[Handle]) -> None:
        """Step until every request in `seqs` has finished (`engine_api.run_to_completion`)."""
        engine_api.run_to_completion(self, seqs)

    def generate(self, prompts: Iterable[str | SequenceOf[int]],
                 params: SamplingParams | SequenceOf[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, submitted together in order; outputs in the same order (`params`:
        one for all, one per prompt, or None: greedy)."""
        return engine_api.generate(self, prompts, params, default=SamplingParams(temperature=0.0))
