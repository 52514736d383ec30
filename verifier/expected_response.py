"""What the server writes for a receipt (`detent_audit/server/responses.py`, rebuilt here from the receipt and
the deployment's tokenizer): the text, the logprob blocks (chat entries, the legacy block, an echo's) and the
stop reason; and `first_difference`, where a received block first differs from it (token strings and ints
exactly, logprobs as fp32 bits, alternatives in order)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from detent_audit.errors import BadInput
from detent_audit.manifests.receipt import Receipt
from detent_audit.verifier.response_view import CHAT

if TYPE_CHECKING:
    from detent_audit.runtime.tokenizer import Tokenizer


def _f32(value: object, where: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"the response's {where} must be a number, got {type(value).__name__}")
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond fp32: no fp32 logprob has these bits
        return struct.pack("<d", value)


def first_difference(expected: object, got: object, where: str) -> str | None:
    """The first place where `got` (parsed JSON) differs from `expected` (as the server writes it): fields,
    lengths, order, strings and ints exactly, floats (logprobs) as fp32 bits; a field `got` adds is a
    difference unless null (an SDK's dump adds those)."""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{where}: expected an object"
        extra = sorted(k for k, v in got.items() if k not in expected and v is not None)
        missing = sorted(k for k in expected if k not in got)
        if extra or missing:
            return f"{where}: " + (f"fields {extra} the server never sends" if extra
                                   else f"no field {missing}")
        return next((d for k in expected
                     if (d := first_difference(expected[k], got[k], f"{where}.{k}"))), None)
    if isinstance(expected, list):
        if not isinstance(got, list):
            return f"{where}: expected a list"
        if len(got) != len(expected):
            return f"{where}: {len(got)} entries, the receipt's {len(expected)}"
        return next((d for i, (e, g) in enumerate(zip(expected, got))
                     if (d := first_difference(e, g, f"{where}[{i}]"))), None)
    if isinstance(expected, float):
        if _f32(got, where) != struct.pack("<f", expected):
            return f"{where}: {got!r}, the receipt's {expected!r} (fp32 bits differ)"
        return None
    if got != expected or type(got) is not type(expected):
        return f"{where}: {json.dumps(got)[:80]}, the receipt's {json.dumps(expected)[:80]}"
    return None


def legacy_pairs(block: object) -> object:
    """A legacy logprobs block with each position's top_logprobs as [token, logprob] pairs, in order (a JSON
    object's order is the server's, most likely first)."""
    if not isinstance(block, dict) or not isinstance(block.get("top_logprobs"), list):
        return block
    tops = [list(map(list, t.items())) if isinstance(t, dict) else t for t in block["top_logprobs"]]
    return {**block, "top_logprobs": tops}


class Expected:
    """What the server writes for one receipt (its text, logprobs block and stop reason), with the
    deployment's tokenizer where token strings are needed."""

    def __init__(self, tokenizer: Callable[[], Tokenizer]) -> None:
        self._get: Callable[[], Tokenizer] = tokenizer
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._get()
        return self._tokenizer

    def prompt_text(self, r: Receipt, given: str | None) -> str:
        return self.tokenizer.decode(list(r.request.prompt_token_ids)) if given is None else given

    def logprobs(self, r: Receipt, endpoint: str, echo: bool, prompt_text: str, as_ids: bool) -> object:
        from detent_audit.server.responses import (
            TextStream,
            TokenFormatter,
            chat_logprobs,
            completion_logprobs,
            echo_logprobs,
        )

        s, out = r.request.sampling, r.output
        if s.logprobs is None:
            return None
        fmt, ids, tops = TokenFormatter(self.tokenizer), list(out.token_ids), out.top_logprobs
        if endpoint == CHAT:
            return chat_logprobs(fmt, ids, out.logprobs, tops, as_ids)["content"]
        if not echo:
            offsets = TextStream(self.tokenizer).offsets(ids)
            return completion_logprobs(fmt, ids, out.logprobs, tops, offsets, as_ids)
        assert r.scoring is not None
        prompt_tops = r.scoring.tops if r.scoring.top_n else [[] for _ in range(r.scoring.num_positions)]
        return echo_logprobs(fmt, list(r.request.prompt_token_ids), ids, r.scoring.logprobs, out.logprobs,
                             prompt_tops, tops, prompt_text, as_ids)

    def stop_reason(self, r: Receipt) -> object:
        from detent_audit.server.responses import stop_reason

        s = r.request.sampling
        decode = (lambda ids: self.tokenizer.decode(ids)) if s.stop else None
        return stop_reason(list(r.output.token_ids), r.output.finish_reason, s.stop_token_ids, s.stop, decode)


def no_tokenizer() -> NoReturn:
    raise BadInput("the response's token strings and offsets are checked with the deployment's tokenizer, "
                   "and none was given")


def model_tokenizer(model: str | Path | None, cache_dir: str | None) -> Callable[[], Tokenizer]:
    """The tokenizer of the verifier's `--model` (the receipts' checkpoint, whose tokenizer hash verify
    compares), loaded when first needed."""
    def load() -> Tokenizer:
        from detent_audit.runtime.named_models import resolve_model
        from detent_audit.runtime.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(resolve_model(model, cache_dir).path)
    return load
