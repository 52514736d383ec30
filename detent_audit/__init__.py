"""detent-audit: batch-invariant LLM serving with signed, third-party-checkable receipts."""

from __future__ import annotations

__version__ = "0.1.0"
