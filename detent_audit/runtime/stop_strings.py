"""Stop strings: where a request's output ends because its text contains one, and where the text is cut.

The rule is vLLM's (its detokenizer's stop check, `include_stop_str_in_output` off): after each output token
the output text is detokenized (special tokens skipped); the first token whose text contains one of the stop
strings finishes the request with reason 'stop'; that token stays in the output ids; the returned text is cut
where the stop string begins. When several stop strings appear at that token, the first in the request's
order is the one that counts (vLLM searches them in order). The text of a longer prefix of tokens extends the
text of a shorter one (byte-level detokenization; a trailing incomplete UTF-8 character is a replacement
character no stop string may contain), so "contains a stop string" holds from the stopping token on and never
before: a verifier checks just the last two prefixes (`check_stop`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from detent_audit.errors import BadInput

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
Decode = Callable[[Sequence[int]], str]


class StopHit(NamedTuple):
    """The stop string a text contains (the first of the request's, in order) and where the text is cut."""

    stop: str
    cut: int  # the returned text is text[:cut]


def check_stop_strings(stop: Sequence[str], where: str = "stop") -> tuple[str, ...]:
    """`stop` as a tuple if every entry is a non-empty string without U+FFFD, within the limits; else
    BadInput."""
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS:
        raise BadInput(f"{where} must be a list of at most {MAX_STOP_STRINGS} strings, got {stop!r:.80}")
    for s in stop:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS or "\ufffd" in s:
            raise BadInput(f"{where}: each stop string must be 1-{MAX_STOP_CHARS} characters of text (no "
                           f"U+FFFD, which stands for an incomplete character), got {s!r:.80}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput(f"{where}: {s!r:.80} is not valid Unicode text (it holds a lone "
                           "surrogate)") from None
    return tuple(stop)


def find_stop(text: str, stop: Sequence[str]) -> StopHit | None:
    """The first stop string (in request order) that `text` contains, and the cut before it."""
    for s in stop:
        index = text.find(s)
        if index >= 0:
            return StopHit(s, index)
    return None


def output_text(decode: Decode, output_ids: Sequence[int], stop: Sequence[str]) -> tuple[str, StopHit | None]:
    """The text a response returns for `output_ids`: cut before the stop string it contains, if any."""
    text = decode(output_ids)
    hit = find_stop(text, stop) if stop else None
    return (text if hit is None else text[:hit.cut]), hit


def check_stop(decode: Decode, output_ids: Sequence[int], stop: Sequence[str]) -> tuple[bool, str | None]:
    """(whether the last output token completed a stop string, a problem if an earlier token already had).

    By the prefix property (module docstring) the last two prefixes decide it: the text before the last token
    contains no stop string (so no earlier token stopped), and the full text does (this token stopped)."""
    if not stop or not output_ids:
        return False, None
    before = find_stop(decode(output_ids[:-1]), stop)
    if before is not None:
        return False, ("the output text before its last token already contains the stop string "
                       f"{before.stop!r}, so generation would have stopped earlier")
    return find_stop(decode(output_ids), stop) is not None, None
