"""What every engine behind the contract (`detent_audit.runtime.contract.Engine`) shares, written once:
`EngineBase` (the thread count and mode its config fixes, its own handles told from another engine's, `run`
and `generate` over its own `add_request`/`step`). The embedded engine, vLLM's and SGLang's derive from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from typing import Generic, Protocol, TypeVar

from detent_audit.enums import Mode
from detent_audit.runtime import contract
from detent_audit.runtime.contract import Prompt, RequestHandle, RequestOutput
from detent_audit.runtime.sampling_params import SamplingParams


class EngineSettings(Protocol):
    """The part of an engine's config the base reads."""

    @property
    def mode(self) -> str: ...

    @property
    def num_threads(self) -> int: ...


Handle = TypeVar("Handle", bound=RequestHandle)


class ForeignHandle(TypeError):
    """A handle given to an engine that did not make it (a bug of the caller)."""


class EngineBase(ABC, Generic[Handle]):
    """An engine's requests are `Handle`s (instances of `handle_type`); `config` fixes its mode and thread
    count."""

    name: str
    config: EngineSettings
    handle_type: type[Handle]

    @property
    def num_threads(self) -> int:
        return self.config.num_threads

    @property
    def mode(self) -> Mode:
        return Mode(self.config.mode)

    def own(self, seq: RequestHandle) -> Handle:
        """`seq` as this engine's handle; `ForeignHandle` where another engine made it."""
        if not isinstance(seq, self.handle_type):
            raise ForeignHandle(f"the {self.name} engine was handed a {type(seq).__name__}, not its own "
                                "request")
        return seq

    @abstractmethod
    def add_request(self, prompt: Prompt, params: SamplingParams,
                    request_id: str | None = None) -> Handle: ...

    @abstractmethod
    def step(self) -> list[Handle]: ...

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def output_of(self, seq: RequestHandle) -> RequestOutput: ...

    def run(self, seqs: SequenceOf[Handle]) -> None:
        """Step until every request in `seqs` has finished (`contract.run_to_completion`)."""
        contract.run_to_completion(self, seqs, self.name)

    def generate(self, prompts: Iterable[Prompt],
                 params: SamplingParams | SequenceOf[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, submitted together in order; outputs in the same order (`params`:
        one for all, one per prompt, or None: greedy)."""
        return contract.generate(self, prompts, params, default=SamplingParams(temperature=0.0),
                                 name=self.name)

    def shutdown(self) -> None:
        """Nothing to stop: an engine that starts processes or threads of its own overrides this."""
