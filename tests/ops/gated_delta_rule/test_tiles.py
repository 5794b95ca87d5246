"""Kernel tiles: the per-target tables, their fallback and the checks on
what the op is given (numerics at non-default tiles: test_kernels.py)."""

import pytest

from gdnx.ops import chunk_gated_delta_rule
from gdnx.ops.gated_delta_rule import GpuTiles, TpuTiles, tiles_for
from tests.ops.gated_delta_rule.cases import Case, make_inputs


def test_tiles_are_checked():
    q, k, v, g, beta, _ = make_inputs(Case("ht", b=1, t=16, dk=16, dv=16, hk=2, hv=4, chunk=16))
    with pytest.raises(ValueError, match="head_tile=3 must divide the key heads HK=2"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="pallas_tpu", tiles=TpuTiles(3))
    with pytest.raises(TypeError, match="tiles: implementation='pallas_gpu' takes GpuTiles or None, got TpuTiles"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="pallas_gpu", tiles=TpuTiles(1))
    with pytest.raises(ValueError, match="tiles: applies to the Pallas implementations"):
        chunk_gated_delta_rule(q, k, v, g, beta, implementation="xla", tiles=GpuTiles())
    with pytest.raises(ValueError, match="tiles.block_v: expected a power of two >= 16, got 48"):
        GpuTiles(block_v=48)
    with pytest.raises(ValueError, match="tiles.block_k: expected a power of two >= 16, got 8"):
        GpuTiles(block_k=8)
    with pytest.raises(ValueError, match="tiles.grads_num_warps: expected a positive int, got 0"):
        GpuTiles(grads_num_warps=0)


def test_tiles_table_falls_back_off_target():
    """On the CPU both kernels take their fallback entries."""
    from gdnx.ops.gated_delta_rule.tiles import GPU_FALLBACK, TPU_FALLBACK

    assert tiles_for("pallas_gpu") == GPU_FALLBACK and tiles_for("pallas_tpu") == TPU_FALLBACK
