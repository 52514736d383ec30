"""SelIR: kernel selection as analysable programs, the pin solver and compiled selectors."""

from __future__ import annotations
