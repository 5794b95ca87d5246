"""Kernel tiles: the per-target tables, their fallback and the checks on
what the op is given (numerics at non-default tiles: test_kernels.py)."""

import pytest

from gdnx.ops import chunk_gated_delta_rule
from gdnx.ops.delta_rule import GpuTiles, TpuTiles, tiles_for
from tests.ops.delta_rule.cases import Case, make_inputs


def test_tiles_are_checked():
    q, k, v, g, beta, _ = make_inputs(Case("ht", b=1, t=16, dk=16, dv=16, hk=2, hv=4, chunk=16))
    with pytest.raises(ValueError, match="head_tile=3 must divide the key heads HK=2"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="pallas_tpu", tiles=TpuTiles(head_tile=3))
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


def test_tpu_head_tile_takes_whole_lanes():
    """The TPU kernels read q, k, v where the tokens lie: a head tile's
    lanes (its heads x the head dim) are a multiple of 128 or every head.
    Two key heads of K=32 are 64 lanes, refused naming the field; all four
    run, with the xla path's result."""
    import jax.numpy as jnp

    q, k, v, g, beta, _ = make_inputs(Case("lanes", b=1, t=32, dk=32, dv=32, hk=4, hv=8, chunk=16))
    with pytest.raises(ValueError, match=r"tiles.head_tile=2: a tile's key heads x K=32 and value heads x V=32 must "
                                         r"be multiples of 128 lanes, or the tile every key head \(HK=4\)"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="pallas_tpu", interpret=True,
                               tiles=TpuTiles(head_tile=2))
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="pallas_tpu", interpret=True,
                                  tiles=TpuTiles(head_tile=4))
    ref, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="xla")
    assert float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref)) < 1e-5  # float32 rounding


def test_tiles_table_falls_back_off_target():
    """On the CPU both kernels take their fallback entries."""
    from gdnx.ops.delta_rule.tiles import GPU_FALLBACK, TPU_FALLBACK

    assert tiles_for("pallas_gpu") == GPU_FALLBACK and tiles_for("pallas_tpu") == TPU_FALLBACK


def test_table_entry_is_fitted_to_the_heads_of_the_call():
    """A target's entry (TPU v5p's: 16 value heads of K = V = 128 a grid
    step) takes as many key heads as fit and divide the call's: 8 of
    Qwen3-Next's 16 (2 value heads each), 4 at 3 value heads each, all 3 of
    a call with three small heads, where the kernel runs (interpret mode)
    with the xla path's result. Explicit tiles that do not fit are refused,
    naming the field."""
    import types

    import jax.numpy as jnp

    from gdnx.ops.delta_rule.tiles import choose_tiles, compile_target

    v5p = types.SimpleNamespace(platform="tpu", device_kind="TPU v5")
    with compile_target(v5p):  # type: ignore[arg-type]
        entry = tiles_for("pallas_tpu")
        assert entry == TpuTiles(value_heads=16, vmem_limit_mib=60) == choose_tiles("pallas_tpu", None, key_heads=4)
        assert entry.key_heads_per_step(16, 2, 64, 128, 128) == 8
        assert entry.key_heads_per_step(16, 3, 64, 128, 128) == 4
        assert entry.key_heads_per_step(3, 1, 16, 16, 16) == 3
        q, k, v, g, beta, _ = make_inputs(Case("odd_heads", b=1, t=16, dk=16, dv=16, hk=3, hv=3, chunk=16))
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="pallas_tpu", interpret=True)
    assert tiles_for("pallas_tpu") == TpuTiles()  # the context is left
    ref, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, implementation="xla")
    assert float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref)) < 1e-5  # float32 rounding
    with pytest.raises(ValueError, match=r"tiles.head_tile=2 must divide the key heads HK=3"):
        choose_tiles("pallas_tpu", TpuTiles(head_tile=2), key_heads=3)
    with pytest.raises(ValueError, match=r"tiles.value_heads: expected a positive int, got 0"):
        TpuTiles(value_heads=0)


def test_a_program_traced_for_a_tpu_on_a_cpu_host_gets_the_real_kernel():
    """Under compile_target (how `gdnx plan` traces a slice's program on a
    CPU host), the defaults follow the target, not the host's backend: the
    TPU kernel is chosen and traced for the compiler, not for the
    interpreter, whose host callbacks remat refuses ("Effects not supported
    in partial-eval of checkpoint"). Off target both defaults are the CPU's."""
    import types

    import jax
    import jax.numpy as jnp

    from gdnx.ops.delta_rule.dispatch import default_implementation
    from gdnx.ops.delta_rule.pallas import resolve_interpret
    from gdnx.ops.delta_rule.tiles import compile_target
    from gdnx.ops.gated_delta_rule.api import IMPLEMENTATIONS as TABLE

    q, k, v, g, beta, _ = make_inputs(Case("target", b=1, t=16, dk=16, dv=16, hk=2, hv=2, chunk=16))

    def loss(q):
        return jnp.sum(chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)[0])

    assert default_implementation(TABLE) == "xla" and resolve_interpret(None)
    with compile_target(types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")):  # type: ignore[arg-type]
        assert default_implementation(TABLE) == "pallas_tpu" and not resolve_interpret(None)
        traced = jax.make_jaxpr(jax.grad(jax.checkpoint(loss)))(q)
    assert not traced.effects, traced.effects
    assert "pallas_call" in str(traced)
