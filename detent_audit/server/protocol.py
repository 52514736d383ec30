"""The OpenAI-compatible request schema: JSON bodies checked field by field into a `ParsedRequest`.

Supported (both endpoints): model (must name the served model), max_tokens, temperature, top_p, seed (recorded
in the receipt and returned as `seed`; a sampled request without one gets the node's derived seed, a greedy
one 0), stop (a string or a list of strings: vLLM's rule, stop_strings.py; recorded in the receipt), stream,
stream_options.include_usage, user (ignored), and the vLLM-style extensions top_k (0 or -1 = off),
stop_token_ids, ignore_eos, return_tokens_as_token_ids; n (choices per prompt, each sampled with its own seed
and signed in its own receipt: manifests/seeds.py) and best_of (accepted equal to n; vLLM ignores it, a
best_of above n is refused: the ranking that would drop choices is no part of a receipt). /v1/completions:
prompt (a string, a list of token ids, or a batch: a list of strings or of token-id lists, one choice and one
receipt each), logprobs (int, top-n), echo (the prompt's text and, with logprobs, each prompt token's logprob
and top-n before the output's; max_tokens may then be 0: score the prompt, draw nothing).
/v1/chat/completions: messages (role and text content, rendered by the checkpoint's chat template), logprobs
(bool), top_logprobs (int), max_completion_tokens, and vLLM's add_generation_prompt (default true),
continue_final_message (end the prompt inside the final message, for the model to continue it; not with
add_generation_prompt) and chat_template_kwargs (more variables for the template, e.g. enable_thinking),
rendered as transformers' `apply_chat_template` renders them (engine/tokenizer.py). Refused with 400: unknown
fields, and fields whose effect the engine cannot produce or a receipt cannot record (best_of above n, suffix,
logit_bias, penalties, tools, response_format; a batch or echo streamed). Every refusal is an `InvalidRequest`
naming the field (`param`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from detent_audit.errors import BadInput
from detent_audit.manifests.receipt import MAX_STOP_TOKENS
from detent_audit.runtime.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams, seed_for
from detent_audit.runtime.stop_strings import check_stop_strings
from detent_audit.runtime.tokenizer import RESERVED_TEMPLATE_NAMES

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
           "ignore_eos", "stream", "stream_options", "user", "return_tokens_as_token_ids", "n", "best_of"}
_COMPLETION = _COMMON | {"prompt", "logprobs", "echo"}
MAX_BATCH = 256  # prompts in one /v1/completions request, and choices (prompts times n) in one response
_CHAT = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs"}
_ROLES = ("system", "developer", "user", "assistant")
# field -> (values that mean "off", why another value is refused)
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": (("",), "insertion is not supported"),
    "logit_bias": (({},), "the engine applies no logit processors"),
    "presence_penalty": ((0, 0.0), "sampling is temperature, top_k and top_p only"),
    "frequency_penalty": ((0, 0.0), "sampling is temperature, top_k and top_p only"),
    "repetition_penalty": ((1, 1.0), "sampling is temperature, top_k and top_p only"),
    "tools": (([],), "tool calls are not supported"),
    "tool_choice": (("none",), "tool calls are not supported"),
    "functions": (([],), "function calls are not supported"),
    "function_call": (("none",), "function calls are not supported"),
    "parallel_tool_calls": ((False,), "tool calls are not supported"),
    "response_format": (({"type": "text"},), "structured output is not supported"),
}


class InvalidRequest(BadInput):
    """A request refused with `status` (400, or 404 for an unknown model); `param` names the field."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value",
                 status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


@dataclass(frozen=True)
class Limits:
    """What the served engine can take (read from it once)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_prompt_chars: int | None = None  # text longer than this cannot fit in max_model_len tokens

    @classmethod
    def of(cls, model_name: str, max_model_len: int, vocab_size: int, tokenizer: Any) -> Limits:
        """With `max_prompt_chars` = max_model_len times the longest vocabulary entry (no token covers more
        characters), so an overlong text is refused before it is tokenized (which would take seconds and
        GBs)."""
        return cls(model_name, max_model_len, vocab_size, max_model_len * tokenizer.max_token_chars())


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`'s object hook: an object whose key repeats is refused (as not valid JSON), since which
    value counts would be a guess."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r} appears more than once in one object")
            seen.add(key)
    return out


def check_text(text: str, param: str) -> str:
    """`text`, if it encodes as UTF-8 (a lone surrogate does not, and no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{param}' is not valid Unicode text (it holds a lone surrogate)", param=param,
                             code="invalid_type") from None
    return text


def _fits(texts: list[str], param: str, limits: Limits) -> None:
    chars = sum(map(len, texts))
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise InvalidRequest(f"this model's maximum context length is {limits.max_model_len} tokens; the "
                             f"prompt has {chars} characters, more than that many tokens can hold",
                             param=param, code="context_length_exceeded")


@dataclass(frozen=True)
class ParsedRequest:
    """A checked request: its prompts as token ids (one per choice) and the engine's sampling parameters.
    With `max_tokens` 0 (echo only) the engine still draws one token (`params.max_tokens` is 1), which the
    response and the receipt leave out."""

    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool          # return per-token logprobs
    tokens_as_ids: bool     # token strings as "token_id:<id>"
    echo: bool = False      # return the prompt (text, and its logprobs with `logprobs`) before the output
    max_tokens: int = 1     # as requested (0: echo only)
    prompt_texts: tuple[str | None, ...] = ()  # the prompts given as text (None: given as token ids)
    batched: bool = False   # the prompt was a list of prompts: receipts are named `<id>-<index>`
    n: int = 1              # choices per prompt: choice `index` answers prompt index // n (its choice: % n)
    seeds: tuple[int, ...] = ()  # each choice's seed (of a prompt), as the node sets them; empty: params.seed

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt of a one-prompt request."""
        return self.prompts[0]

    @property
    def multi(self) -> bool:
        """Whether the response has several choices (a batch, or n > 1): receipt i is named `<id>-<i>`."""
        return self.batched or self.n > 1

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def params_of(self, index: int) -> SamplingParams:
        """The sampling of choice `index`: its own seed (`seeds`, one per choice of a prompt, when set)."""
        if not self.seeds:
            return self.params
        return dataclasses.replace(self.params, seed=self.seeds[index % self.n])


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _get(body: dict, name: str, kind: type, default: Any, lo: Any = None, hi: Any = None) -> Any:
    """body[name] checked as `kind` in [lo, hi] (None or absent: `default`)."""
    value = body.get(name)
    if value is None:
        return default
    kinds = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
    if not _is(value, kind) or (kind is float and not math.isfinite(value)):
        raise InvalidRequest(f"'{name}' must be {kinds[kind]}, got {value!r}", param=name,
                             code="invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{lo}, {'inf' if hi is None else hi}]"
        raise InvalidRequest(f"'{name}' must be in {bounds}, got {value!r}", param=name)
    return value


def check_token_ids(value: Any, name: str, limits: Limits, most: int | None = None) -> list[int]:
    """`value` as a list of token ids of the vocabulary (and at most `most` of them)."""
    if not isinstance(value, list) or not all(_is(t, int) and 0 <= t < limits.vocab_size for t in value):
        raise InvalidRequest(f"'{name}' must be a list of token ids in [0, {limits.vocab_size - 1}]",
                             param=name, code="invalid_type")
    if most is not None and len(value) > most:
        raise InvalidRequest(f"'{name}' has {len(value)} token ids, more than the {most} a receipt can "
                             "record", param=name)
    return value


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name in sorted(body):
        if name in _UNSUPPORTED:
            neutral, why = _UNSUPPORTED[name]
            value = body[name]
            if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
                raise InvalidRequest(f"'{name}' is not supported: {why}", param=name, code="unsupported")
        elif name not in allowed:
            raise InvalidRequest(f"unrecognized request argument: '{name}'", param=name, code="unknown_field")


def parse_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages", code="invalid_type")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES or set(m) - {"role", "content", "name"}:
            raise InvalidRequest(f"{where} must be {{'role': one of {', '.join(_ROLES)}, 'content': text}}",
                                 param=where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequest(f"{where}.content: only text parts are supported",
                                     param=f"{where}.content")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string", param=f"{where}.content",
                                 code="invalid_type")
        out.append({"role": m["role"], "content": check_text(content, f"{where}.content")})
    return out


def _chat_extras(body: dict) -> tuple[bool, bool, dict[str, Any] | None]:
    """add_generation_prompt, continue_final_message and chat_template_kwargs, checked as vLLM checks them."""
    generation = _get(body, "add_generation_prompt", bool, True)
    continued = _get(body, "continue_final_message", bool, False)
    if generation and continued:
        raise InvalidRequest("cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
                             param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs",
                             code="invalid_type")
    reserved = sorted(RESERVED_TEMPLATE_NAMES & set(kwargs or {}))
    if reserved:
        raise InvalidRequest(f"'chat_template_kwargs' may not set {', '.join(reserved)}: the request's own "
                             "fields do", param="chat_template_kwargs")
    return generation, continued, kwargs or None


def parse_request(body: Any, chat: bool, limits: Limits, tokenizer: Any) -> ParsedRequest:
    """Check one request body; raises `InvalidRequest` (or `BadInput` from the chat template)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(body, _CHAT if chat else _COMPLETION)
    model = _get(body, "model", str, limits.model_name)
    if model != limits.model_name:
        raise InvalidRequest(f"the model '{model}' does not exist (this server serves '{limits.model_name}')",
                             param="model", code="model_not_found", status=404)
    if chat:
        messages = parse_messages(body.get("messages"))
        _fits([m["content"] for m in messages], "messages", limits)
        prompt_ids = tokenizer.encode_chat(messages, *_chat_extras(body))
        top_n = _get(body, "top_logprobs", int, None, 0, MAX_LOGPROBS)
        want_logprobs = _get(body, "logprobs", bool, False)
        if top_n is not None and not want_logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        texts: tuple[str | None, ...] = (None,)
        prompts, batched = [prompt_ids], False
        echo = False
    else:
        prompts, texts, batched = _prompts(body.get("prompt"), limits, tokenizer)
        top_n = _get(body, "logprobs", int, None, 0, MAX_LOGPROBS)
        want_logprobs = top_n is not None
        echo = _get(body, "echo", bool, False)
    param = "messages" if chat else "prompt"
    for i, prompt_ids in enumerate(prompts):
        where = f"{param}[{i}]" if batched else param
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty (it encodes to no tokens)", param=where)
        if limits.max_model_len - len(prompt_ids) < 1:
            raise InvalidRequest(f"this model's maximum context length is {limits.max_model_len} tokens; the "
                                 f"prompt has {len(prompt_ids)} tokens, which leaves no room for output",
                                 param=where, code="context_length_exceeded")
    longest = max(map(len, prompts))
    room = limits.max_model_len - longest
    max_tokens = _get(body, "max_tokens", int, None, 0 if echo else 1)
    if chat:
        alias = _get(body, "max_completion_tokens", int, None, 1)
        if None not in (alias, max_tokens) and alias != max_tokens:
            raise InvalidRequest("'max_tokens' and 'max_completion_tokens' differ",
                                 param="max_completion_tokens")
        max_tokens = max_tokens or alias or room  # chat: up to the context left, as OpenAI's API does
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens > room:
        raise InvalidRequest(f"this model's maximum context length is {limits.max_model_len} tokens; the "
                             f"prompt has {longest} tokens and max_tokens is {max_tokens}",
                             param="max_tokens", code="context_length_exceeded")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    try:
        stop = check_stop_strings(stop, "'stop'")
    except BadInput as exc:
        raise InvalidRequest(exc.message, param="stop") from None
    n = _get(body, "n", int, 1, 1, MAX_BATCH)
    best_of = _get(body, "best_of", int, None, 1, MAX_BATCH)
    if best_of is not None and best_of != n:
        raise InvalidRequest(f"'best_of' {best_of} is not 'n' {n}: choosing the best of more samples than "
                             "are returned ranks them by a score no receipt binds; send best_of = n or omit "
                             "it",
                             param="best_of", code="unsupported")
    if len(prompts) * n > MAX_BATCH:
        raise InvalidRequest(f"{len(prompts)} prompts times n = {n} is more than the {MAX_BATCH} choices one "
                             "response may hold", param="n")
    stream = _get(body, "stream", bool, False)
    if stream and (batched or echo):
        raise InvalidRequest("a batch of prompts or 'echo' is answered whole, not streamed: "
                             "send 'stream': false", param="stream", code="unsupported")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise InvalidRequest("'stream_options' must be {'include_usage': bool}, with 'stream': true",
                             param="stream_options")
    _get(body, "user", str, None)
    top_k = _get(body, "top_k", int, 0, -1, 2**31 - 1)
    top_p = float(_get(body, "top_p", float, 1.0, 0, 1))
    if top_p == 0:
        raise InvalidRequest("'top_p' must be in (0, 1], got 0", param="top_p")
    temperature = float(_get(body, "temperature", float, 1.0, 0))
    params = SamplingParams(
        temperature=temperature, top_k=max(top_k, 0), top_p=top_p, max_tokens=max(max_tokens, 1),
        seed=seed_for(temperature, _get(body, "seed", int, None, 0, MAX_SEED)),
        stop_token_ids=tuple(check_token_ids(body.get("stop_token_ids") or [], "stop_token_ids", limits,
                                             MAX_STOP_TOKENS)),
        ignore_eos=_get(body, "ignore_eos", bool, False), logprobs=(top_n or 0) if want_logprobs else None,
        stop=stop)
    return ParsedRequest(chat, [list(p) for p in prompts], params, stream,
                         _get(options or {}, "include_usage", bool, False), want_logprobs,
                         _get(body, "return_tokens_as_token_ids", bool, False), echo, max_tokens,
                         tuple(texts), batched, n)


def _prompts(prompt: Any, limits: Limits,
             tokenizer: Any) -> tuple[list[list[int]], tuple[str | None, ...], bool]:
    """A completion's prompts as token ids, the texts given (None for ids), and whether it was a batch: one
    string, one list of token ids, or a non-empty list of either."""
    def one(value: Any, where: str) -> tuple[list[int], str | None] | None:
        if isinstance(value, str):
            return tokenizer.encode(check_text(value, where)), value
        if isinstance(value, list) and value and all(_is(t, int) for t in value):
            return check_token_ids(value, where, limits), None
        return None

    if isinstance(prompt, str):
        _fits([prompt], "prompt", limits)
    single = one(prompt, "prompt")
    if single is not None:
        return [single[0]], (single[1],), False
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_BATCH:
        _fits([p for p in prompt if isinstance(p, str)], "prompt", limits)
        items = [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        present = [item for item in items if item is not None]
        if len(present) == len(items):
            return [ids for ids, _ in present], tuple(text for _, text in present), True
    raise InvalidRequest(f"'prompt' must be a string, a non-empty list of token ids, or a list of "
                         f"1-{MAX_BATCH} of those (a batch: one choice and one receipt each)", param="prompt",
                         code="invalid_type")
