"""/tokenize, /detokenize and /tokenizer_info, in vLLM's request and response shapes.

lm-eval's `local-completions` with no `tokenizer=` probes /tokenizer_info (it needs `eos_token`) and
/tokenize, then tokenizes through them (its remote tokenizer), so an evaluation needs no local copy of
the checkpoint.

- POST /tokenize `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...],
  "add_generation_prompt": true}` (the served chat template) -> `{"count", "max_model_len", "tokens",
  "token_strs"}` (`token_strs` with `"return_token_strs": true`, else null).
- POST /detokenize `{"tokens": [int]}` -> `{"prompt": str}`.
- GET /tokenizer_info -> the tokenizer's special tokens, chat template, class and context length.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from detent_audit.errors import BadInput
from detent_audit.server.bodies import read_body
from detent_audit.server.completions import _parse_body
from detent_audit.server.protocol import InvalidRequest, check_text, check_token_ids, parse_messages
from detent_audit.server.state import ServerState, error_response, json_response, state_of

_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                    "return_token_strs"}


async def _body(state: ServerState, request: Request) -> dict[str, Any]:
    held = [0]
    try:
        body = await run_in_threadpool(_parse_body, await read_body(request, state.budget, held))
    finally:
        state.budget.give(held[0])
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise InvalidRequest(f"the model '{model}' does not exist (this server serves '{state.model_name}')",
                             param="model", code="model_not_found", status=404)
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean, got {value!r}", param=name, code="invalid_type")
    return value


def _tokenize(state: ServerState, body: dict[str, Any]) -> list[int]:
    unknown = sorted(set(body) - _TOKENIZE_FIELDS)
    if unknown:
        raise InvalidRequest(f"unrecognized request argument: '{unknown[0]}'", param=unknown[0],
                             code="unknown_field")
    tokenizer, limits = state.engine.tokenizer, state.limits
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("give exactly one of 'prompt' (text) and 'messages' (a chat)", param="prompt")
    if "messages" in body:
        messages = parse_messages(body["messages"])
        chars = sum(len(m["content"]) for m in messages)
        text = None
    else:
        text = body["prompt"]
        if not isinstance(text, str):
            raise InvalidRequest("'prompt' must be a string", param="prompt", code="invalid_type")
        chars = len(check_text(text, "prompt"))
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise InvalidRequest(f"the text has {chars} characters, more than this model's context of "
                             f"{limits.max_model_len} tokens can hold", param="prompt",
                             code="context_length_exceeded")
    if text is not None:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", True))
        return ids
    generation_prompt = _flag(body, "add_generation_prompt", True)
    return list(tokenizer.encode_chat(messages, add_generation_prompt=generation_prompt))


async def tokenize(request: Request) -> Response:
    state = state_of(request)
    try:
        body = await _body(state, request)
        ids = await run_in_threadpool(_tokenize, state, body)
        strs = [state.fmt.text(t, False) for t in ids] if _flag(body, "return_token_strs", False) else None
    except BadInput as exc:
        return error_response(exc)
    return json_response({"count": len(ids), "max_model_len": state.limits.max_model_len, "tokens": ids,
                          "token_strs": strs})


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    try:
        body = await _body(state, request)
        unknown = sorted(set(body) - {"model", "tokens"})
        if unknown:
            raise InvalidRequest(f"unrecognized request argument: '{unknown[0]}'", param=unknown[0],
                                 code="unknown_field")
        ids = check_token_ids(body.get("tokens"), "tokens", state.limits)
        text = await run_in_threadpool(state.engine.tokenizer.decode, ids)
    except BadInput as exc:
        return error_response(exc)
    return json_response({"prompt": text})


async def tokenizer_info(request: Request) -> Response:
    """As vLLM's: the special tokens as text (lm-eval encodes them to find their ids), the chat template. The
    engine contract names only encode/decode and the EOS ids: the rest is read where the tokenizer has it."""
    state = state_of(request)
    tokenizer = state.engine.tokenizer
    eos = getattr(tokenizer, "eos_token", None)
    if eos is None:  # named only by id (generation_config): its text
        eos = state.fmt.text(tokenizer.eos_token_ids[0], False)
    backend = getattr(tokenizer, "tokenizer", tokenizer)
    return json_response({"tokenizer_class": type(backend).__name__, "eos_token": eos,
                          "bos_token": getattr(tokenizer, "bos_token", None), "pad_token": None,
                          "chat_template": getattr(tokenizer, "chat_template", None),
                          "model_max_length": state.limits.max_model_len,
                          "vocab_size": state.limits.vocab_size})
