"""The plugin's control of SGLang's scheduler, in every mode: the chunked-prefill size set while it runs.

SGLang reads `--chunked-prefill-size` once, into `Scheduler.chunked_prefill_size`, and lets no request change
it (`Scheduler.set_internal_state` accepts a fixed list of knobs, not this one); a new size would cost a
restart of SGLang's scheduler, which takes minutes on a CPU. The hook wraps `set_internal_state`: a request
naming `CHUNK_KEY` alone sets the size the next prefill batch is cut with (SGLang's own RPC path, from the
tokenizer manager to the scheduler); any other request reaches SGLang's own handler unchanged. It is no
kernel: stock mode gets it too, and what it changes is what `facts()["scheduler"]` names.
"""

from __future__ import annotations

from typing import Any

CHUNK_KEY = "detent_chunked_prefill_size"
TARGET = "sglang.srt.managers.scheduler.Scheduler.set_internal_state"


def set_internal_state(original: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of `Scheduler.set_internal_state`. Refuses (updated=False) while a chunked prefill is in
    flight, or a size that is not a positive integer."""
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    asked = getattr(recv_req, "server_args", None) or {}
    if set(asked) != {CHUNK_KEY}:
        return original(scheduler, recv_req, *args, **kwargs)
    size = asked[CHUNK_KEY]
    ok = (isinstance(size, int) and not isinstance(size, bool) and size >= 1
          and getattr(scheduler, "chunked_req", None) is None)
    if ok:
        scheduler.chunked_prefill_size = size
    return SetInternalStateReqOutput(updated=ok)


def hooks() -> dict[str, tuple[str, Any]]:
    """target -> (hook type name, hook)."""
    return {TARGET: ("AROUND", set_internal_state)}
