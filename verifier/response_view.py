"""What a client's OpenAI SDK shows of a response: the text, finish reason and logprobs of each choice, read
as `openai.types.chat.ChatCompletion`, `openai.types.Completion` and their stream chunks read them, and
nothing else (`response_view`).

A chat answer is `choices[i].message.content`, a completion's `choices[i].text`; a stream's is the
concatenation of its chunks' `choices[i].delta.content` (chat) or `choices[i].text` (completions), per choice
index. The SDK keeps any other field it is given (its models allow extra fields) without showing it as the
answer, so a field the server never sends (a `text` in a chat choice, a `delta` beside a `message`, a
`refusal`) is a difference the view names: text there would be text the client's code does not read. A field
an SDK dump adds empty (`"refusal": null`) is no such field. Values of the wrong type (choices that are no
list, a choice that is a string) are malformed input (`BadInput`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from detent_audit.errors import BadInput
from detent_audit.manifests.encoding import JsonValue

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
API_OF = {CHAT: "openai/v1/chat/completions", COMPLETIONS: "openai/v1/completions"}  # a receipt's client.api
OBJECT_OF = {(CHAT, False): "chat.completion", (CHAT, True): "chat.completion.chunk",
             (COMPLETIONS, False): "text_completion", (COMPLETIONS, True): "text_completion"}
# the fields the server sends (detent_audit/server/completions.py): a response, a chunk, and their choices
_TOP = {"id", "object", "created", "model", "system_fingerprint", "choices", "usage", "seed", "receipt_id",
        "receipt", "receipt_ids"}
_CHOICE = {CHAT: {"index", "message", "finish_reason", "logprobs", "stop_reason", "receipt_id", "receipt"},
           COMPLETIONS: {"index", "text", "logprobs", "finish_reason", "stop_reason", "receipt_id",
                         "receipt"}}
_CHUNK_CHOICE = {CHAT: {"index", "delta", "logprobs", "finish_reason", "receipt_id", "receipt"},
                 COMPLETIONS: {"index", "text", "logprobs", "finish_reason", "receipt_id", "receipt"}}
_MESSAGE = {"role", "content"}
_CHAT_LOGPROBS = {"content"}
_LEGACY_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@dataclass
class ChoiceView:
    """One choice as the SDK shows it; `logprobs`: the chat entries (a list) or the legacy block (a dict of
    lists), streamed chunks' concatenated, or None where the response returned none."""

    text: str = ""
    finish_reason: str | None = None
    logprobs: Any = None
    stop_reason: object = None
    receipt_id: object = None
    proof: object = None


@dataclass
class ResponseView:
    """A response (or a stream's chunks) as the client's SDK reads it; `problems`: the fields it holds that
    the SDK does not show as the answer, and values that disagree between a stream's chunks."""

    endpoint: str
    stream: bool
    # top-level field -> its values, chunk by chunk
    heads: dict[str, list[object]] = field(default_factory=dict)
    choices: dict[int, ChoiceView] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def one(self, name: str) -> object:
        """A top-level field's value: every chunk that has it (not null) must agree (else a problem)."""
        values = [v for v in self.heads.get(name, []) if v is not None]
        if any(v != values[0] for v in values[1:]):
            self.problems.append(f"the stream's chunks disagree on {name}")
        return values[0] if values else None


def _object(value: object, where: str) -> dict[str, JsonValue]:
    if not isinstance(value, dict):
        raise BadInput(f"the response's {where} must be a JSON object, got {type(value).__name__}")
    return value


def _extra(obj: Mapping[str, object], allowed: set[str], where: str, problems: list[str], shows: str) -> None:
    """Fields of `obj` (not null) that the server never sends there: the SDK does not show them as the
    answer."""
    for key in sorted(k for k, v in obj.items() if k not in allowed and v is not None):
        problems.append(f"{where}.{key}: a field the client's SDK does not show as the answer ({shows})")


def response_view(response: object, endpoint: str) -> ResponseView:
    """The view of a response body (a JSON object) or a stream (the list of its chunks) from `endpoint`.
    Raises `BadInput` for a malformed response."""
    if endpoint not in API_OF:
        raise BadInput(f"unknown endpoint {endpoint!r}", remedy=f"use one of {', '.join(API_OF)}")
    stream = isinstance(response, list)
    chunks: list[object] = response if isinstance(response, list) else [response]
    if not chunks:
        raise BadInput("the response is an empty list: a stream has at least one chunk")
    shows = ("it shows choices[i].delta.content" if stream else "it shows choices[i].message.content") \
        if endpoint == CHAT else "it shows choices[i].text"
    view = ResponseView(endpoint, stream)
    for n, item in enumerate(chunks):
        chunk = _object(item, f"chunk {n}" if stream else "body")
        where = f"chunk {n}" if stream else "response"
        _extra(chunk, _TOP, where, view.problems, shows)
        for key in _TOP - {"choices"}:
            if key in chunk:
                view.heads.setdefault(key, []).append(chunk[key])
        created = chunk.get("created")
        if created is not None and (isinstance(created, bool) or not isinstance(created, int)):
            view.problems.append(f"{where}.created: {str(created)[:40]!r} is not a time (whole seconds)")
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise BadInput(f"the response's {where}.choices must be a list, got {type(choices).__name__}")
        for position, choice in enumerate(choices):
            _read_choice(view, _object(choice, f"{where}.choices[{position}]"), position, f"{where}.choices",
                         shows)
    return view


def _read_choice(view: ResponseView, choice: dict[str, JsonValue], position: int, where: str,
                 shows: str) -> None:
    """One choice (or a chunk's choice) into `view.choices[its index]`."""
    index = choice.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise BadInput(f"the response's {where}[{position}].index must be a choice index, got {index!r}")
    if not view.stream and index != position:  # the SDK's choices[i] is the list's i-th
        view.problems.append(f"{where}[{position}] has index {index}: the client's SDK shows it as choice "
                             f"{position}")
    here = f"{where}[{position}]"
    if not view.stream and index in view.choices:
        view.problems.append(f"{here}: a second choice of index {index}")
    got = view.choices.setdefault(index, ChoiceView())
    allowed = (_CHUNK_CHOICE if view.stream else _CHOICE)[view.endpoint]
    _extra(choice, allowed, here, view.problems, shows)
    if view.endpoint == CHAT:
        holder = "delta" if view.stream else "message"
        message = choice.get(holder)
        if message is not None:
            message = _object(message, f"{here}.{holder}")
            _extra(message, _MESSAGE, f"{here}.{holder}", view.problems, shows)
            if message.get("role") not in (None, "assistant"):
                view.problems.append(f"{here}.{holder}.role: {str(message['role'])[:40]!r}, not 'assistant'")
        piece = None if message is None else message.get("content")
    else:
        piece = choice.get("text")
    if piece is not None and not isinstance(piece, str):
        raise BadInput(f"the response's {here} text must be a string, got {type(piece).__name__}")
    got.text += piece or ""
    for name in ("finish_reason", "stop_reason", "receipt_id", "receipt"):
        value = choice.get(name)
        if value is None:
            continue
        attribute = "proof" if name == "receipt" else name
        before = getattr(got, attribute)
        if before is not None and before != value:
            view.problems.append(f"{here}.{name} {value!r} differs from an earlier chunk's {before!r}")
        setattr(got, attribute, value)
    _read_logprobs(view, got, choice.get("logprobs"), f"{here}.logprobs")


def _read_logprobs(view: ResponseView, got: ChoiceView, block: object, where: str) -> None:
    """A choice's logprobs block, appended to what earlier chunks gave."""
    if block is None:
        return
    block = _object(block, where)
    if view.endpoint == CHAT:
        _extra(block, _CHAT_LOGPROBS, where, view.problems, "it shows logprobs.content")
        content = block.get("content")
        if content is None:
            return
        if not isinstance(content, list):
            raise BadInput(f"the response's {where}.content must be a list, got {type(content).__name__}")
        got.logprobs = [*(got.logprobs or []), *content]
        return
    _extra(block, set(_LEGACY_LOGPROBS), where, view.problems,
           "it shows tokens, token_logprobs, top_logprobs, text_offset")
    merged = got.logprobs or {k: [] for k in _LEGACY_LOGPROBS}
    for key in _LEGACY_LOGPROBS:
        values = block.get(key)
        if values is None:
            continue
        if not isinstance(values, list):
            raise BadInput(f"the response's {where}.{key} must be a list, got {type(values).__name__}")
        merged[key] = [*merged[key], *values]
    got.logprobs = merged
