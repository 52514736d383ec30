"""Why a sequence finished: the one rule the scheduler applies after every token and the verifier rechecks.

After each output token, in this order: the token is a stop token (one of the request's `stop_token_ids`, or
an EOS id unless `ignore_eos`) -> 'stop'; the output's text now contains a stop string -> 'stop'; the output
holds `max_tokens` tokens, or prompt and output fill `max_model_len` -> 'length'; else generation goes on. A
stop wins over a length limit reached on the same token. Whether a stop string completed is the caller's to
say (the scheduler decodes the output, the verifier uses `stop_strings.check_stop`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]  # the wire value (receipts, OpenAI responses)


class FinishCause(enum.Enum):
    """What ended a sequence; `reason` is the wire value it is reported as."""

    STOP_TOKEN = "a stop token"
    EOS = "an EOS token"
    STOP_STRING = "a token whose text completes a stop string"
    MAX_TOKENS = "max_tokens"
    MAX_MODEL_LEN = "max_model_len"

    @property
    def reason(self) -> FinishReason:
        return "length" if self in (FinishCause.MAX_TOKENS, FinishCause.MAX_MODEL_LEN) else "stop"


class FinishParams(Protocol):
    """What of a request's sampling the rule reads (`SamplingParams`, a receipt's `SamplingRecord`)."""

    @property
    def stop_token_ids(self) -> Collection[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def max_tokens(self) -> int: ...


def finish_cause(last_token: int, num_output_tokens: int, num_tokens: int, params: FinishParams,
                 eos_token_ids: Collection[int], max_model_len: int, *, stop_string: bool = False
                 ) -> FinishCause | None:
    """Why a sequence of `num_tokens` tokens (`num_output_tokens` of them drawn, the last `last_token`)
    finishes now, or None when it goes on. `stop_string`: the output's text contains one of its stop strings
    (and did not before this token)."""
    if last_token in params.stop_token_ids:
        return FinishCause.STOP_TOKEN
    if not params.ignore_eos and last_token in eos_token_ids:
        return FinishCause.EOS
    if stop_string:
        return FinishCause.STOP_STRING
    if num_output_tokens >= params.max_tokens:
        return FinishCause.MAX_TOKENS
    if num_tokens >= max_model_len:
        return FinishCause.MAX_MODEL_LEN
    return None
