"""The seed of a sampled request that named none: derived from the run and the request, never drawn.

    seed = int.from_bytes(SHA-256(DOMAIN || run_id || 0x00 || api || 0x00 || body_sha256 || 0x00 ||
                                  choice as 4 bytes little-endian)[:8], "little")

`run_id` is the node's run, fixed when the node starts (before it answers any request) and named in every
receipt and manifest of the run; `api` and `body_sha256` are the request as its client sent it (the receipt's
`request.client`); `choice` is the index of the answer among the request's choices (0 while a request has one;
a batch's prompts share their request's seed, as they share one the client gives). A node cannot pick another
seed for a request once it has seen it, and a verifier recomputes it from the receipt alone.

A request that names its seed and asks for `n` > 1 choices samples choice i with `choice_seed(seed, i)` =
(seed + i) mod 2**64: vLLM's rule (each choice of a seeded request gets seed + its index), so choice 0 keeps
the client's seed and no two choices of one request share one. A request answered in several choices names
each receipt `<response id>-<index>`, index = prompt * n + choice (the OpenAI order of `choices`), and the
receipt's bound body holds `n`: a verifier reads the choice from the two.
"""

from __future__ import annotations

import hashlib

DOMAIN = b"detent-audit unseeded sample v1\0"
MAX_CHOICE = 2**32 - 1
_SEEDS = 2**64


def derived_seed(run_id: str, api: str, body_sha256: str, choice: int = 0) -> int:
    """The unsigned 64-bit seed of choice `choice` of an unseeded sampled request in run `run_id`."""
    if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice <= MAX_CHOICE:
        raise ValueError(f"choice must be an integer in [0, {MAX_CHOICE}], got {choice!r}")
    h = hashlib.sha256(DOMAIN)
    for part in (run_id, api, body_sha256):
        h.update(part.encode("utf-8") + b"\0")
    h.update(choice.to_bytes(4, "little"))
    return int.from_bytes(h.digest()[:8], "little")


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request whose client named `seed` (vLLM's seed + index, mod 2**64)."""
    if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice <= MAX_CHOICE:
        raise ValueError(f"choice must be an integer in [0, {MAX_CHOICE}], got {choice!r}")
    return (seed + choice) % _SEEDS
