"""OpenAI-format response bodies and stream chunks: token strings, logprob blocks, incremental text.

Logprobs are the engine's fp32 values written as Python floats (shortest round-trip decimal of the double,
which is exact for every fp32 value): parsing the JSON and rounding to fp32 gives back the receipt's bits. A
non-finite logprob (JSON has none) is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from detent_audit.runtime.stop_strings import find_stop, output_text
from detent_audit.runtime.tokenizer import bytes_to_unicode

LOGPROB_FLOOR = -9999.0
_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE alphabet -> byte


def json_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class TokenFormatter:
    """A token's string (its decoded text, or "token_id:<id>") and its bytes (byte-level BPE tokens map
    back to their exact bytes; other tokens give the UTF-8 of their decoded text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.token_piece(token_id)
        if piece is not None and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
        return list(self.text(token_id, False).encode("utf-8"))


class TextStream:
    """The output text of one request, token by token: `push` returns the new text (held back while it ends
    in an incomplete UTF-8 character, or, with stop strings, in what could begin one) and `flush` the rest;
    their concatenation is the response's text (decode(all tokens), cut before a stop string:
    stop_strings.py)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max(map(len, self.stop), default=1) - 1  # characters that could be a stop string's start
        self.ids: list[int] = []
        self.sent = ""

    def _text(self, final: bool) -> str:
        text, hit = output_text(self.tokenizer.decode, self.ids, self.stop)
        if hit is None and not final and self.hold:
            text = text[:max(len(self.sent), len(text) - self.hold)]
        return text

    def offsets(self, new_ids: Sequence[int]) -> list[int]:
        """Character offset of each of `new_ids` in the final text (call before `push`)."""
        ids, out = list(self.ids), []
        for token_id in new_ids:
            out.append(len(self.tokenizer.decode(ids)))
            ids.append(token_id)
        return out

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self._text(final=False)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def flush(self) -> str:
        text = self._text(final=True)
        piece = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return piece


def completion_logprobs(fmt: TokenFormatter, ids: Sequence[int], logprobs: Sequence[float],
                        tops: Sequence[Sequence[tuple[int, float]]], offsets: Sequence[int],
                        as_ids: bool) -> dict[str, Any]:
    """The legacy block: tokens, token_logprobs, top_logprobs (the top-n, plus the sampled token, as
    OpenAI's legacy API lists it), text_offset."""
    top_dicts = []
    for token_id, value, alternatives in zip(ids, logprobs, tops):
        entry = {fmt.text(a, as_ids): json_logprob(v) for a, v in alternatives}
        entry.setdefault(fmt.text(token_id, as_ids), json_logprob(value))
        top_dicts.append(entry)
    return {"tokens": [fmt.text(t, as_ids) for t in ids],
            "token_logprobs": [json_logprob(v) for v in logprobs],
            "top_logprobs": top_dicts, "text_offset": list(offsets)}


def echo_logprobs(fmt: TokenFormatter, prompt_ids: Sequence[int], ids: Sequence[int],
                  prompt_logprobs: Sequence[float], logprobs: Sequence[float],
                  prompt_tops: Sequence[Sequence[tuple[int, float]]],
                  tops: Sequence[Sequence[tuple[int, float]]], prompt_text: str, as_ids: bool
                  ) -> dict[str, Any]:
    """An echo's legacy block: the prompt's tokens, then the output's (the prompt's first token without a
    logprob: nothing precedes it, as vLLM does), offsets into the prompt's text followed by the output's."""
    both = [*prompt_ids, *ids]
    block = completion_logprobs(fmt, both[1:], [*prompt_logprobs, *logprobs], [*prompt_tops, *tops], [],
                                as_ids)
    offsets = TextStream(fmt.tokenizer).offsets(prompt_ids)
    offsets += [len(prompt_text) + o for o in TextStream(fmt.tokenizer).offsets(ids)]
    return {"tokens": [fmt.text(both[0], as_ids), *block["tokens"]],
            "token_logprobs": [None, *block["token_logprobs"]],
            "top_logprobs": [None, *block["top_logprobs"]], "text_offset": offsets}


def stop_reason(ids: Sequence[int], finish_reason: str | None, stop_token_ids: Sequence[int],
                stop: Sequence[str], decode: Any) -> str | int | None:
    """What stopped the output, as vLLM reports it: the stop string its text contained, a stop token id, or
    None (EOS or length)."""
    if finish_reason != "stop" or not ids:
        return None
    if ids[-1] in stop_token_ids:
        return ids[-1]
    hit = find_stop(decode(list(ids)), stop) if stop else None
    return None if hit is None else hit.stop


def chat_logprobs(fmt: TokenFormatter, ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]], as_ids: bool) -> dict[str, Any]:
    """The chat block: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def entry(token_id: int, value: float) -> dict[str, Any]:
        return {"token": fmt.text(token_id, as_ids), "logprob": json_logprob(value),
                "bytes": fmt.bytes(token_id)}

    return {"content": [{**entry(t, v), "top_logprobs": [entry(a, av) for a, av in alts]}
                        for t, v, alts in zip(ids, logprobs, tops)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
