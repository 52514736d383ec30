"""The families' parameter spaces: legal values construct, illegal ones raise BadParams; grids are legal."""

from __future__ import annotations

import pytest

from detent_audit.errors import DetentError
from detent_audit.kernels.params import (
    ATTENTION_GRID,
    ATTENTION_KV_TILE_SPACE,
    ATTENTION_SPLIT_STRIDE_SPACE,
    GEMM_CHUNK_ROWS_SPACE,
    GEMM_FORMS,
    GEMM_GRID,
    GEMM_PAD_ROWS_SPACE,
    MOE_GRID,
    AttentionParams,
    BadParams,
    GemmParams,
    MoeParams,
)


def test_spaces_are_the_documented_ranges():
    assert GEMM_CHUNK_ROWS_SPACE == tuple(2**i for i in range(9))
    assert ATTENTION_KV_TILE_SPACE == (16, 32, 64, 128, 256, 512)
    assert ATTENTION_SPLIT_STRIDE_SPACE[0] == 0
    assert GEMM_FORMS == ("chunk", "pad", "row", "fixed")
    assert len(GEMM_GRID) == 9 + len(GEMM_PAD_ROWS_SPACE) + 1 and len(MOE_GRID) == 9
    assert {g.gemm.form for g in MOE_GRID} == {"chunk"}  # the expert GEMMs keep the chunk form
    assert len(ATTENTION_GRID) == len(ATTENTION_KV_TILE_SPACE) * len(ATTENTION_SPLIT_STRIDE_SPACE)


@pytest.mark.parametrize("chunk_rows", [0, 3, 12, 512, -4, True, 4.0])
def test_bad_chunk_rows(chunk_rows):
    with pytest.raises(BadParams) as err:
        GemmParams(chunk_rows)
    assert isinstance(err.value, DetentError) and err.value.remedy


@pytest.mark.parametrize("chunk_rows, form", [(3, "pad"), (0, "pad"), (256, "pad"), (2, "row"), (4, "Pad"),
                                             (4, None), (4, "")])
def test_bad_gemm_forms(chunk_rows, form):
    with pytest.raises(BadParams) as err:
        GemmParams(chunk_rows, form)
    assert err.value.remedy


def test_gemm_form_labels():
    assert [GemmParams(16).label, GemmParams(4, "pad").label, GemmParams(1, "row").label] == \
        ["chunk:16", "pad:4", "row"]
    assert GemmParams(12, "pad").chunk_rows == 12  # a pad size that is no chunk size


@pytest.mark.parametrize(
    "kv_tile, split_stride",
    [(8, 0), (1024, 0), (48, 0), (16, -16), (64, 96), (64, 32), (32, 1)],
)
def test_bad_attention_params(kv_tile, split_stride):
    with pytest.raises(BadParams):
        AttentionParams(kv_tile, split_stride)


def test_good_params_and_derived_values():
    assert AttentionParams(64, 256).tiles_per_split == 4
    assert AttentionParams(16).split_stride == 0 and AttentionParams(16).tiles_per_split == 0
    assert MoeParams(GemmParams(8)).gemm.chunk_rows == 8
    with pytest.raises(BadParams):
        MoeParams(gemm=8)


def test_params_are_frozen_and_hashable():
    params = AttentionParams(32, 64)
    with pytest.raises(AttributeError):
        params.kv_tile = 64  # type: ignore[misc]
    assert len({params, AttentionParams(32, 64), GemmParams(4)}) == 2
