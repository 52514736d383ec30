"""The seed of a sampled request that named none: derived from the run and the request, never drawn.

    seed = int.from_bytes(SHA-256(DOMAIN || run_id || 0x00 || api || 0x00 || body_sha256 || 0x00 ||
                                  choice as 4 bytes little-endian)[:8], "little")

`run_id` is the node's run, fixed when the node starts (before it answers any request) and named in every
receipt and manifest of the run; `api` and `body_sha256` are the request as its client sent it (the receipt's
`request.client`); `choice` is the index of the answer among the request's choices (0 while a request has one;
a batch's prompts share their request's seed, as they share one the client gives). A node cannot pick another
seed for a request once it has seen it, and a verifier recomputes it from the receipt alone.
"""

from __future__ import annotations

import hashlib

DOMAIN = b"detent-audit unseeded sample v1\0"
MAX_CHOICE = 2**32 - 1


def derived_seed(run_id: str, api: str, body_sha256: str, choice: int = 0) -> int:
    """The unsigned 64-bit seed of choice `choice` of an unseeded sampled request in run `run_id`."""
    if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice <= MAX_CHOICE:
        raise ValueError(f"choice must be an integer in [0, {MAX_CHOICE}], got {choice!r}")
    h = hashlib.sha256(DOMAIN)
    for part in (run_id, api, body_sha256):
        h.update(part.encode("utf-8") + b"\0")
    h.update(choice.to_bytes(4, "little"))
    return int.from_bytes(h.digest()[:8], "little")
