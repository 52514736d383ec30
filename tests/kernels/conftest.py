"""Shared fixtures for the kernel tests: a fixed thread count (restored in finally) and a seeded generator."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import torch

from detent_audit.runtime.threads import thread_count


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The test body runs at 1 and at 2 threads (the thread count is a deployment fact: bits may change)."""
    with thread_count(request.param):
        yield request.param


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: fresh random inputs per test, reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def randn(gen: torch.Generator):
    """randn(*shape, dtype=fp32, scale=1.0): standard normal noise (never zeros) in the given dtype."""

    def make(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return make


@pytest.fixture
def with_threads():
    """with_threads(n): the thread_count context manager, for tests that compare thread counts."""
    return thread_count


@pytest.fixture
def interpreter_loop_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's CPU interpreter under numpy 2: a loop bound loaded from memory is a 1-element array, which
    int() refuses; index such tensors by their one element (the interpreter tiers' tests use this)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
