"""Where detent-audit keeps what it can rebuild: `$DETENT_AUDIT_CACHE`, else the platform's user cache folder.

Every cache names its subfolder here (`selir`: solved programs; `models`: imported and generated checkpoints;
`weight-hashes.json`); a `--cache-dir` option replaces the root for one run.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DETENT_AUDIT_CACHE"


def cache_root(*parts: str) -> Path:
    """The cache root (`$DETENT_AUDIT_CACHE`, else the user cache directory) joined with `parts`."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).joinpath(*parts)
    import platformdirs

    return Path(platformdirs.user_cache_dir("detent-audit")).joinpath(*parts)
