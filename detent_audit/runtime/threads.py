"""torch's intra-op thread count, set one way everywhere and checked (a count is a deployment fact: BLAS bits
depend on it).

vLLM's CPU worker, once imported in a process, replaces `torch.set_num_threads` with a function that only
logs, so a count set through it silently stays what it was. `set_threads` goes through torch's own
`torch._C.set_num_threads`, which nothing replaces, and reads the count back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from detent_audit.errors import BadInput, DetentError


class ThreadCountNotSet(DetentError):
    """torch runs another thread count than the one asked for (the facts would record a count not run)."""

    remedy = ("start the process with OMP_NUM_THREADS set to the count asked for, and without a library that "
              "pins torch's thread pool")


def set_threads(n: int) -> None:
    """Run torch's intra-op work of the calling thread at `n` threads; raises `ThreadCountNotSet` when torch
    then reports another count."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadInput(f"a thread count must be a whole number >= 1, got {n!r}")
    torch._C.set_num_threads(n)
    running = torch.get_num_threads()
    if running != n:
        raise ThreadCountNotSet(f"torch runs {running} threads after {n} were asked for")


@contextmanager
def thread_count(n: int) -> Iterator[None]:
    """The body runs at `n` threads (`set_threads`); the count before is restored after, also on failure."""
    previous = torch.get_num_threads()
    set_threads(n)
    try:
        yield
    finally:
        set_threads(previous)
