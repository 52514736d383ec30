"""The engine contract: what `serve`, `verify` and `battery` need from an engine, and nothing more.

Three engines implement it: the embedded one (`detent_audit.engine`, the default), vLLM
(`detent_audit.integrations.vllm`, the `[vllm]` extra) and SGLang (`detent_audit.integrations.sglang`). Each
is found in `detent_audit.runtime.registry` by its `--engine` name or by the name its facts record
(`facts["engine"]["name"]`); no command names an engine's class.

The protocol is step-based: `add_request` queues a request and returns its handle, `step` runs one scheduled
step and returns the handles that finished in it, `output_of` hands a finished request's `RequestOutput` over.
`generate` and `rescore_batch` are the offline forms built on the same steps; `run_to_completion` and
`generate` below are the one implementation of the first, which every engine's `run`/`generate` call.
Everything that crosses the contract is a value (token ids, floats, JSON facts, `SamplingParams`): an engine
may run its model in other processes (SGLang's scheduler does; tensor parallelism will), and nothing here
assumes the model lives in the caller's process.

Contract of every implementation (the tests hold the engines to it):
- tokens and logprobs: `output_logprobs[i]` is the fp32 log-softmax of the raw logits (before temperature,
  top-k, top-p) at output token i, as a Python float (an fp32 value, exactly);
- seeded sampling: the draw at an output position depends on (seed, absolute position, vocabulary index) and
  the logits only, so a seeded request draws the same tokens alone and in any batch; temperature 0 is argmax;
- `rescore_batch(pairs, params)`: teacher-forced, the logprob of each output token after the prompt and the
  outputs before it, and the token `params` would draw there: equal, bit for bit, to what generation gave;
- `facts()`: every setting that changes bits (engine name and version, model hashes, threads, dtype, page
  size, chunking, prefix caching, kernels and the tuple, the facts' format), plain JSON types, no floats;
  `facts()["engine"]["name"]` and `["version"]` name the implementation;
- `output_of(handle)` of a request the engine refused after admitting it (SGLang's scheduler refuses one
  beyond the context its selection was solved for) raises a `DetentError` for that request alone;
- `abort(handle)` frees a live request between steps; it never finishes and is never signed;
- `reset()` forgets every request and the prefix cache; with requests unfinished it raises unless
  `drop_unfinished`;
- `shutdown()` stops what the engine started beside the caller (processes, threads); it may be called twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeAlias, runtime_checkable

from detent_audit.enums import Mode
from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import SamplingParams

EMBEDDED = "detent-audit"  # facts["engine"]["name"] of the embedded engine

# facts and tuples are JSON without floats (a float's bits are not a fact): a section -> its record
Facts: TypeAlias = "dict[str, Mapping[str, object]]"
TupleValues: TypeAlias = "dict[str, Mapping[str, object]]"  # family (and "mode") -> axis -> value
Prompt: TypeAlias = "str | SequenceOf[int]"
TopLogprobs: TypeAlias = "list[list[tuple[int, float]]]"  # per position: the top-n (token id, fp32 logprob)


class Rescored(NamedTuple):
    logprobs: list[float]   # fp32 values, one per output token
    tokens: list[int]       # the token the request's sampling draws at each output position
    tops: TopLogprobs = []  # with the sampling's logprobs=n: the top-n at each position


@dataclass
class RequestOutput:
    """A finished request, as `output_of` hands it over."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]                                   # fp32 values, one per output token
    finish_reason: str | None
    top_logprobs: TopLogprobs = field(default_factory=list)
    num_cached_tokens: int = 0
    # echo: the fp32 logprob of every prompt token after the first, and their top-n (None: not asked)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: TopLogprobs | None = None


class TokenizerLike(Protocol):
    @property
    def eos_token_ids(self) -> SequenceOf[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: SequenceOf[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(self, messages: SequenceOf[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: Mapping[str, object] | None = None) -> list[int]: ...

    def max_token_chars(self) -> int: ...       # characters of the longest vocabulary entry

    def token_piece(self, token_id: int) -> str | None: ...  # the vocabulary entry of a token, if it has one


class RequestHandle(Protocol):
    """A request inside an engine, as `add_request` returns it (read-only for callers; handed back to the
    engine that made it, which refuses another engine's)."""

    @property
    def seq_id(self) -> int: ...                # the engine's key, unique among live requests

    @property
    def request_id(self) -> str: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_logprobs(self) -> list[float]: ...


class Stepping(Protocol):
    """The part of `Engine` that running requests to completion needs."""

    def add_request(self, prompt: Prompt, params: SamplingParams,
                    request_id: str | None = None) -> RequestHandle: ...

    def step(self) -> SequenceOf[RequestHandle]: ...

    def has_unfinished(self) -> bool: ...

    def output_of(self, seq: RequestHandle) -> RequestOutput: ...


@runtime_checkable
class Engine(Protocol):
    """An engine that serve, verify and battery can drive. See the module docstring for the contract."""

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_threads(self) -> int: ...

    @property
    def mode(self) -> Mode: ...

    @property
    def model_name(self) -> str: ...            # the model's name, as `/v1/models` and the facts give it

    @property
    def model_positions(self) -> int: ...       # the model's own context (max_position_embeddings)

    @property
    def block_size(self) -> int: ...            # tokens per KV page (the prefix cache shares whole pages)

    def facts(self) -> Facts: ...

    def tuple_values(self) -> TupleValues: ...

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, *,
                    score_prompt: bool = False) -> RequestHandle: ...  # score_prompt: echo (or BadInput)

    def step(self) -> SequenceOf[RequestHandle]: ...

    def has_unfinished(self) -> bool: ...

    def output_of(self, seq: RequestHandle) -> RequestOutput: ...

    def top_logprobs_so_far(self, seq: RequestHandle) -> TopLogprobs: ...

    def abort(self, seq: RequestHandle) -> None: ...

    def reset(self, *, max_prefill_chunk: int | None = None, drop_unfinished: bool = False) -> None: ...
    # max_prefill_chunk: tokens of one request's prefill per step from now on; None: the configured one

    def generate(self, prompts: Iterable[Prompt],
                 params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 ) -> list[RequestOutput]: ...

    def rescore_batch(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                      params: SequenceOf[SamplingParams] | None = None) -> list[Rescored]: ...

    def shutdown(self) -> None: ...


class EngineStopped(RuntimeError):
    """An engine had requests unfinished but nothing left to step (a bug of the engine, not of the input)."""


def run_to_completion(engine: Stepping, handles: SequenceOf[RequestHandle], name: str = "engine") -> None:
    """Step `engine` until every request in `handles` has finished (others may finish alongside)."""
    pending = {h.seq_id for h in handles}
    while pending:
        if not engine.has_unfinished():
            raise EngineStopped(f"the {name} engine stopped with requests unfinished")
        for handle in engine.step():
            pending.discard(handle.seq_id)


def generate(engine: Stepping, prompts: Iterable[Prompt],
             params: SamplingParams | SequenceOf[SamplingParams] | None, *, default: SamplingParams,
             name: str = "engine") -> list[RequestOutput]:
    """Every prompt run to completion, submitted together in order; `engine.output_of` each, in the same
    order. `params`: one sampling-parameter object for all, a sequence of one per prompt, or None
    (`default`)."""
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [default if params is None else params] * len(prompts)
    if len(params) != len(prompts):
        raise BadInput(f"{len(prompts)} prompts but {len(params)} sampling parameters")
    handles = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_to_completion(engine, handles, name)
    return [engine.output_of(h) for h in handles]
