"""The ordered all-reduce's arithmetic: the ranks' partial sums added in rank order in a stated precision.

The detent all-reduce does no arithmetic inside the collective: the partials are all-gathered (copies only),
then every rank adds them in rank order 0..N-1 in float32 (`ordered_sum`), so every rank holds the same bits
and one process that has the N partials (rank emulation) adds them to the same bits. The embedded engine's
ranks (`engine/tensor_parallel.py`) and vLLM's CPU communicator under the plugin
(`integrations/vllm/plugin.py`) both sum here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ORDERED = "ordered-gather-sum"   # the detent all-reduce: all-gather, then a sum in rank order
BACKEND = "backend"              # the stock all-reduce: the process group's own (gloo's or NCCL's) sum
ACCUMULATE = "float32"           # the ordered sum's precision (a fact)


def ordered_sum(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """partials[0] + partials[1] + ... in this order, in float32, cast back to the partials' dtype."""
    acc = partials[0].to(torch.float32)
    for p in partials[1:]:
        acc = acc + p.to(torch.float32)
    return acc.to(partials[0].dtype)
