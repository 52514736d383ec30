"""The dtypes by name: every one a checkpoint may hold, and the ones the engine computes in.

The names and their widths are `manifests.deployment.DTYPE_BYTES` (the facts name a dtype); this is the same
table with torch's dtypes, so a name is checked against one list everywhere.
"""

from __future__ import annotations

import torch

from detent_audit.manifests.deployment import DTYPE_BYTES

# name -> torch dtype: what a checkpoint may store and the loader may cast to
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in sorted(DTYPE_BYTES)}
# what the engine runs (the kernels and their references are written for these; float16 only loads)
RUN_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def dtype_name(dtype: str | torch.dtype) -> str:
    """`dtype`'s name ("float32" for torch.float32 or "float32")."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
