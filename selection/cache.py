"""The JIT cache: solved programs on disk, keyed by everything that can change the answer.

Location: `--cache-dir`, else `$DETENT_AUDIT_CACHE/selir`, else the user cache directory. An entry is JSON
`{"key", "sha256", "body"}` written atomically (temporary file, fsync, rename). On load the key and the
SHA-256 of the canonical body must match; anything else (truncation, corruption, a different key) is a
miss, the entry is removed and the program solved again: a bad entry is never trusted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from detent_audit.atomic import write_atomically
from detent_audit.cache_dir import cache_root
from detent_audit.manifests.encoding import canonical_json, sha256_hex


def cache_key(parts: Mapping[str, object]) -> str:
    return sha256_hex(canonical_json(parts))


class JitCache:
    """get/put of solve results by key. `last_status` says 'hit', 'miss' or 'corrupt' for the last get."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_root("selir")
        self.last_status = "miss"

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            self.last_status = "miss"
            return None
        except OSError:
            self.last_status = "corrupt"
            return None
        try:
            entry = json.loads(raw)
            body = entry["body"]
            ok = entry["key"] == key and entry["sha256"] == sha256_hex(canonical_json(body))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            self.last_status = "corrupt"
            path.unlink(missing_ok=True)
            return None
        self.last_status = "hit"
        return body

    def discard(self, key: str) -> None:
        """A body that loaded but does not read as a result: removed, and the last get counts as corrupt."""
        self.path(key).unlink(missing_ok=True)
        self.last_status = "corrupt"

    def put(self, key: str, body: dict) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, canonical_json({"key": key, "sha256": sha256_hex(canonical_json(body)),
                                          "body": body}))
