"""Each kernel family's parameter space: frozen, validated dataclasses and the tuner's grid.

A params object is everything that may change a row's bits besides the row's own inputs (and the deployment
facts: dtype, shapes of the weights, CPU thread count). Fixing it is what a pin does; the family's kernels
then guarantee that a row's output bits depend only on that row (attention: on its own KV and its absolute
positions). A params object that exists is legal: constructors raise `BadParams` otherwise.

The grid (`*_SPACE` per field, `*_GRID` for the product) lists every legal value the tuner may commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from detent_audit.errors import DetentError


class BadParams(DetentError):
    """A kernel parameter outside its family's legal space."""

    remedy = "pick a value from the family's *_SPACE in detent_audit.kernels.params"


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a chunk size is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadParams(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


GEMM_CHUNK_ROWS_SPACE: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# "chunk": every BLAS call has exactly chunk_rows rows; "pad": one product over the batch, padded to at least
# chunk_rows rows; "row": every row its own product (chunk_rows == 1); "fixed": the project's own C product
# whose order is written out (kernels/gemm_c.py; chunk_rows == 1), the same bits on every CPU. pad and row
# rest on a property of the BLAS that only a probe on the running CPU can show (kernels/gemm_probe.py): the
# engine refuses to start with either unless the probe proved it there.
GEMM_FORMS: tuple[str, ...] = ("chunk", "pad", "row", "fixed")
GEMM_PAD_ROWS_SPACE: tuple[int, ...] = (2, 4, 8, 12, 16, 32, 64)
ATTENTION_KV_TILE_SPACE: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
# Every listed stride is a multiple of every listed tile, so the grid is the full product. Any positive
# multiple of kv_tile is legal; the grid stops at 8192 because longer splits behave as no split on CPU.
ATTENTION_SPLIT_STRIDE_SPACE: tuple[int, ...] = (0, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class GemmParams:
    """How rows go to the BLAS, by `form`:

    - "chunk" (the default): chunks of exactly `chunk_rows` rows, the last zero-padded; the matrix the BLAS
      sees always has M == chunk_rows, so its blocking cannot depend on the batch. chunk_rows is a power of
      two in 1..256 (measured: with power-of-two M a row's bits did not depend on its position in the chunk
      at 1-8 threads, while M in 5..11 did at 2 threads; see gemm.py).
    - "pad": one product over the whole batch, zero-padded to at least `chunk_rows` rows (in
      GEMM_PAD_ROWS_SPACE): invariant only where the BLAS gives a row the same bits for every M >= chunk_rows,
      which `gemm_probe.prove` must show on the running CPU and thread count.
    - "row": every row its own product (chunk_rows == 1; MKL's one-row path): invariant where the probe
      shows that the batched one-row products equal the lone one.
    - "fixed": the project's own fp32 product (kernels/gemm_c.py, chunk_rows == 1), every operation's order
      written out: invariant by construction and the same bits on every CPU (the portable ISA setting's).
    """

    chunk_rows: int
    form: str = "chunk"

    def __post_init__(self) -> None:
        _check_int("chunk_rows", self.chunk_rows)
        if self.form not in GEMM_FORMS:
            raise BadParams(f"GEMM form must be one of {GEMM_FORMS}, got {self.form!r}")
        if self.form == "chunk" and self.chunk_rows not in GEMM_CHUNK_ROWS_SPACE:
            raise BadParams(f"chunk_rows must be a power of two in 1..256, got {self.chunk_rows}")
        if self.form == "pad" and self.chunk_rows not in GEMM_PAD_ROWS_SPACE:
            raise BadParams(f"the pad form's least rows must be one of {GEMM_PAD_ROWS_SPACE}, "
                            f"got {self.chunk_rows}")
        if self.form == "fixed" and self.chunk_rows != 1:
            raise BadParams(f"the fixed form orders each row's products itself (chunk_rows=1), "
                            f"got {self.chunk_rows}")
        if self.form == "row" and self.chunk_rows != 1:
            raise BadParams(f"the row form takes one row per product (chunk_rows=1), got {self.chunk_rows}")

    @property
    def label(self) -> str:
        """chunk:16, pad:4, row: how errors and reports name the form."""
        return self.form if self.form in ("row", "fixed") else f"{self.form}:{self.chunk_rows}"


@dataclass(frozen=True)
class AttentionParams:
    """KV is walked in tiles of `kv_tile` tokens and split every `split_stride` tokens.

    Both are aligned to absolute KV positions: tile j covers [j*kv_tile, (j+1)*kv_tile), split s covers
    [s*split_stride, (s+1)*split_stride). split_stride == 0 means one split (online softmax over all tiles).
    Invariant: split boundaries fall on tile boundaries (split_stride is a multiple of kv_tile).
    """

    kv_tile: int
    split_stride: int = 0

    def __post_init__(self) -> None:
        _check_int("kv_tile", self.kv_tile)
        _check_int("split_stride", self.split_stride)
        if not (_is_power_of_two(self.kv_tile) and 16 <= self.kv_tile <= 512):
            raise BadParams(f"kv_tile must be a power of two in 16..512, got {self.kv_tile}")
        if self.split_stride < 0 or self.split_stride % self.kv_tile:
            raise BadParams(
                f"split_stride must be 0 or a positive multiple of kv_tile={self.kv_tile}, "
                f"got {self.split_stride}"
            )

    @property
    def tiles_per_split(self) -> int:
        """Tiles in one split; 0 when there is no split."""
        return self.split_stride // self.kv_tile


@dataclass(frozen=True)
class MoeParams:
    """Fused MoE: the expert GEMMs run with `gemm`; routing and the slot sum have no parameters."""

    gemm: GemmParams

    def __post_init__(self) -> None:
        if not isinstance(self.gemm, GemmParams):
            raise BadParams(f"MoeParams.gemm must be GemmParams, got {type(self.gemm).__name__}")


GEMM_GRID: tuple[GemmParams, ...] = (*(GemmParams(c) for c in GEMM_CHUNK_ROWS_SPACE),
                                      *(GemmParams(r, "pad") for r in GEMM_PAD_ROWS_SPACE),
                                     GemmParams(1, "row"))
ATTENTION_GRID: tuple[AttentionParams, ...] = tuple(
    AttentionParams(kv_tile=t, split_stride=s)
    for t, s in product(ATTENTION_KV_TILE_SPACE, ATTENTION_SPLIT_STRIDE_SPACE)
)
MOE_GRID: tuple[MoeParams, ...] = tuple(MoeParams(gemm=GemmParams(c)) for c in GEMM_CHUNK_ROWS_SPACE)
