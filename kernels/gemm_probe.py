"""Proof on the running CPU that a GEMM form is batch-invariant on the model's own shapes, before serving.

The "pad" and "row" forms of `GemmParams` rest on how the BLAS blocks a product, which this code does not
control: the pad form needs the BLAS to give a row the same bits for every M >= its least rows, the row form
needs the batched one-row products to equal the lone one. Both were measured on one CPU (gemm.py's
docstring) and both depend on the CPU, the BLAS build and the thread count, so the engine proves the form it
is about to commit where it runs: `check` draws fresh random rows and weights of each of the model's GEMM
shapes, computes every row once in a batch of `max_rows`, then recomputes random subsets of those rows (a
fresh permutation for each size, so a row moves to other positions among other neighbours) at every size in
`batch_sizes` and once alone, and compares the bits with `torch.equal`. The first row that differs fails the
form, naming its shape and batch size. A failure is a refusal: `require` raises `GemmFormNotInvariant`.

A sample is not a proof over every M; the sizes tried are each M up to 24 (where MKL switches paths: M = 1,
2-3, >= 4 at one thread; 5-11 split between threads at two), the sizes next to each power of two up to 256
and the batch sizes of the engine's own limits. `least_pad_rows` walks the pad form's row space upwards from
the failures it sees. Results are memoized per process (form, shapes, dtype, threads).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from detent_audit.enums import ExitCode
from detent_audit.errors import DetentError
from detent_audit.kernels import gemm
from detent_audit.kernels.params import GEMM_PAD_ROWS_SPACE, GemmParams

MAX_ROWS = 256            # the largest batch a probe computes (the reference batch)
# multiply-adds one shape's probe may spend: about 0.05-0.2 s per shape on one core. Small weights get the
# whole schedule; the largest (an LM head, 28M weights) its reference batch and every M up to _DENSE_FLOOR.
MACS_PER_SHAPE = 1.5e9
ROW_FORM_MACS_PER_SHAPE = 3e8   # the row form reads the whole weight once per row (memory-bound)
_DENSE_UP_TO = 24
# every M up to this is tried whatever the budget
_DENSE_FLOOR = {"pad": 12, "chunk": 12, "row": 8, "fixed": 8}
_MEMO: dict[tuple, ProbeReport] = {}
# With more than one thread the BLAS splits an unpadded product's rows between threads by M (M 5..11 gave
# rows in a remainder block other bits at 2 threads); the pad form is offered and accepted at one thread only,
# where no split exists.
PAD_ONE_THREAD = ("the pad form is used at one thread only (with more, the BLAS splits rows between threads "
                  "by M); use the chunk or row form, or one thread")


class GemmFormNotInvariant(DetentError):
    """The committed GEMM form gave a row other bits at some batch size on this CPU."""

    exit_code = ExitCode.NOT_COMPARABLE
    remedy = ("commit a tuple proven on this machine (`detent-audit tune`), use the chunk form "
              "(embedded.gemm.form = \"chunk\"), or run at the thread count the tuple was proven at")


@dataclass(frozen=True)
class ProbeReport:
    """What one probe tried and the first row that differed (None: every row kept its bits)."""

    params: GemmParams
    dtype: str
    threads: int
    shapes: tuple[tuple[int, int], ...]            # (N, K) of each weight
    batch_sizes: tuple[int, ...]                   # every M tried on some shape (plan: which on which)
    failure: tuple[tuple[int, int], int] | None    # ((N, K), M)
    seconds: float

    @property
    def ok(self) -> bool:
        return self.failure is None

    def describe(self) -> str:
        if self.failure is None:
            return (f"{self.params.label} kept every row's bits on {len(self.shapes)} shapes, M in "
                    f"{min(self.batch_sizes)}..{max(self.batch_sizes)} ({len(self.batch_sizes)} sizes), "
                    f"{self.threads} thread(s), {self.dtype}")
        (n, k), m = self.failure
        return (f"GEMM form {self.params.label} is not batch-invariant on this CPU at {self.threads} "
                f"thread(s): a row's bits changed at M={m} (weight {n}x{k}, {self.dtype})")


def batch_sizes(max_rows: int) -> tuple[int, ...]:
    """The batch sizes a probe tries, ascending: every M up to 24, then each power of two and its
    neighbours."""
    sizes = set(range(1, min(_DENSE_UP_TO, max_rows) + 1))
    p = 32
    while p <= max_rows:
        sizes.update(m for m in (p - 1, p, p + 1, p + p // 2) if m <= max_rows)
        p *= 2
    sizes.add(max_rows - 1)
    return tuple(sorted(s for s in sizes if s >= 1))


def plan(n: int, k: int, form: str, max_rows: int = MAX_ROWS) -> tuple[int, tuple[int, ...]]:
    """(reference rows, batch sizes) for one (N, K) weight within the form's budget of multiply-adds: the
    reference batch and then sizes in ascending order while the rows fit, never fewer than every M up to
    _DENSE_FLOOR (12; the row form 8)."""
    floor = _DENSE_FLOOR[form]
    macs = ROW_FORM_MACS_PER_SHAPE if form in ("row", "fixed") else MACS_PER_SHAPE
    budget_rows = int(macs // (n * k))
    ref = max(min(max_rows, budget_rows // 3), min(max_rows, 2 * floor))
    sizes, spent = [], ref
    for m in batch_sizes(ref):
        if m > floor and spent + m > budget_rows:
            break
        sizes.append(m)
        spent += m
    return ref, tuple(sizes)


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") if seed is None else seed)


def check(params: GemmParams, shapes: Iterable[tuple[int, int]], dtype: torch.dtype = torch.float32, *,
          max_rows: int = MAX_ROWS, seed: int | None = None, memo: bool = True) -> ProbeReport:
    """Probe `params` on every (N, K) in `shapes` at the current thread count (fresh random data unless
    `seed`); the report's `failure` is the first (shape, M) where a row's bits differed."""
    shapes = tuple(sorted({(int(n), int(k)) for n, k in shapes}))
    threads = torch.get_num_threads()
    key = (params, shapes, str(dtype), threads, max_rows)
    if memo and seed is None and key in _MEMO:
        return _MEMO[key]
    g = _generator(seed)
    t0 = time.perf_counter()
    failure: tuple[tuple[int, int], int] | None = None
    tried: set[int] = set()
    for n, k in shapes:
        ref, sizes = plan(n, k, params.form, max_rows)
        tried.update(sizes)
        m = _first_failure(params, n, k, dtype, ref, sizes, g)
        if m is not None:
            failure = ((n, k), m)
            break
    report = ProbeReport(params, str(dtype).removeprefix("torch."), threads, shapes, tuple(sorted(tried)),
                         failure, time.perf_counter() - t0)
    if memo and seed is None:
        _MEMO[key] = report
    return report


@torch.no_grad()
def _first_failure(params: GemmParams, n: int, k: int, dtype: torch.dtype, max_rows: int,
                   sizes: Sequence[int], g: torch.Generator) -> int | None:
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    x = torch.randn(max_rows, k, generator=g).to(dtype)
    x[torch.randint(0, max_rows, (max(1, max_rows // 16),), generator=g)] = 0  # zero rows, as padding is
    reference = gemm.linear(x, w, params=params)
    for m in sizes:
        rows = torch.randperm(max_rows, generator=g)[:m]
        if not torch.equal(gemm.linear(x[rows], w, params=params), reference[rows]):
            return m
    lone = int(torch.randint(0, max_rows, (1,), generator=g))
    if not torch.equal(gemm.linear(x[lone:lone + 1], w, params=params), reference[lone:lone + 1]):
        return 1
    return None


def require(params: GemmParams, shapes: Iterable[tuple[int, int]], dtype: torch.dtype, *,
            what: str = "the tuple's") -> ProbeReport | None:
    """The probe's report for a pad or row form (None for the chunk form, invariant by construction);
    raises `GemmFormNotInvariant`, naming `what` and the failing M, where it fails."""
    if params.form == "chunk":
        return None
    if params.form == "pad" and torch.get_num_threads() > 1:
        raise GemmFormNotInvariant(f"{what} embedded.gemm form: {params.label} with "
                                   f"{torch.get_num_threads()} threads: {PAD_ONE_THREAD}")
    report = check(params, shapes, dtype)
    if not report.ok:
        raise GemmFormNotInvariant(f"{what} embedded.gemm form: {report.describe()}")
    return report


def least_pad_rows(shapes: Iterable[tuple[int, int]], dtype: torch.dtype = torch.float32) -> int:
    """The fewest rows the pad form can pad to on this CPU and thread count (0: no row count in
    GEMM_PAD_ROWS_SPACE passed). Each failure at M rules out every count up to M."""
    shapes = tuple(shapes)
    if torch.get_num_threads() > 1:
        return 0  # PAD_ONE_THREAD
    floor = 0
    for rows in GEMM_PAD_ROWS_SPACE:
        if rows <= floor:
            continue
        report = check(GemmParams(rows, "pad"), shapes, dtype)
        if report.failure is None:  # ok
            return rows
        floor = report.failure[1]
    return 0


def row_form_holds(shapes: Iterable[tuple[int, int]], dtype: torch.dtype = torch.float32) -> bool:
    """Whether the row form passes its probe here."""
    return check(GemmParams(1, "row"), shapes, dtype).ok
