"""One decode step of the delta rule (GDN's per-head gate or KDA's
per-channel one), read from and written back into a stack of states.

A model whose layers run under one scan keeps each layer kind's recurrent
states stacked, [R, B, HV, K, V] (R repeats of the cycle), in the decode
loop's carry. Slicing a layer's entry out, stepping it and writing it back
moved each row's state through HBM five times a token (the slice, the
decayed copy, the read for the output, the read and the write of the
update). The TPU kernel here reads each head's state once and writes it
once, in place in the stack (its output aliases the stack): the bandwidth's
limit for a decode step.

    StateStack(stack, layer)  the states and the entry a layer owns
    decode_step(...)          one token for every row: (o, the new stack)

The math is the token recurrence's (gdnx.ops.delta_rule.reference), in the
state's dtype (float32 products on the VPU, no MXU rounding).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from gdnx.ops.delta_rule import pallas
from gdnx.ops.delta_rule.dispatch import l2norm
from gdnx.ops.delta_rule.pallas_tpu import tpu_interpreter
from gdnx.ops.delta_rule.reference import recurrent_reference

# the heads one grid step holds: at most this many bytes of state (float32 K = V = 128: 16 heads), so that
# the double-buffered input and output blocks stay within the default scoped VMEM of every TPU generation
_BLOCK_BYTES = 1 << 20


class StateStack(NamedTuple):
    """stack [R, B, HV, K, V]: a scanned cycle's recurrent states of one
    layer kind; layer: int32 scalar, the repeat a layer reads and writes."""
    stack: jax.Array
    layer: jax.Array


def decode_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, states: StateStack, *,
                scale: float | None = None, use_qk_l2norm: bool = False, decay_dtype: DTypeLike = jnp.float32,
                kernel: bool = False, interpret: bool | None = None) -> tuple[jax.Array, StateStack]:
    """One token for each of B rows from `states.stack[states.layer]`.

    q, k [B, 1, HK, K], v [B, 1, HV, V], g [B, 1, HV] (GDN) or
    [B, 1, HV, K] (KDA), beta [B, 1, HV]: the op's layout
    (gdnx.ops.chunk_gated_delta_rule). kernel: the Pallas TPU kernel that
    updates the stack in place (interpret: None runs it interpreted on a
    CPU); else the token recurrence on the slice, written back. Returns
    (o [B, 1, HV, V] in q's dtype, the stack with the entry updated)."""
    b, t, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    stack, layer = states
    if t != 1:
        raise ValueError(f"q: decode_step takes one token per row, got T={t}")
    if stack.shape[1:] != (b, hv, dk, dv):
        raise ValueError(f"states.stack: expected [R, {b}, {hv}, {dk}, {dv}] for these inputs, got "
                         f"{list(stack.shape)}")
    if g.shape not in ((b, 1, hv), (b, 1, hv, dk)):
        raise ValueError(f"g: expected [{b}, 1, {hv}] or [{b}, 1, {hv}, {dk}], got {list(g.shape)}")
    scale = float(dk ** -0.5 if scale is None else scale)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if not kernel:
        h0 = jax.lax.dynamic_index_in_dim(stack, layer, 0, keepdims=False)
        o, final = recurrent_reference(q, k, v, g, beta, h0, cu_seqlens=None, scale=scale,
                                       state_dtype=stack.dtype, decay_dtype=decay_dtype)
        return o, StateStack(jax.lax.dynamic_update_index_in_dim(stack, final, layer, 0), layer)
    o, stack = _tpu_step(q, k, v, g, beta, stack, jnp.asarray(layer, jnp.int32), scale=scale,
                         decay_dtype=jnp.dtype(decay_dtype), interpret=pallas.resolve_interpret(interpret))
    return o, StateStack(stack, layer)


def head_tile(hv: int, dk: int, dv: int, itemsize: int) -> int:
    """The value heads one grid step takes: the most that divide HV within
    _BLOCK_BYTES of state (at least one)."""
    most = max(1, _BLOCK_BYTES // (dk * dv * itemsize))
    return max(h for h in range(1, min(hv, most) + 1) if hv % h == 0)


def _tpu_step(q, k, v, g, beta, stack, index, *, scale: float, decay_dtype, interpret: bool):
    b, _, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    hb = head_tile(hv, dk, dv, stack.dtype.itemsize)
    nj = hv // hb

    def columns(x, width):
        # [B, 1, HV, width] -> [B, NJ, width, hb]: each head's vector down the sublanes, so that it
        # multiplies the state's rows (K) by a broadcast along the lanes
        return jnp.swapaxes(x.reshape(b, nj, hb, width), 2, 3)

    heads = lambda x: jnp.repeat(x, hv // hk, axis=2) if hv != hk else x  # value head h reads key head h // G
    per_channel = g.ndim == 4
    qc, kc = columns(heads(q), dk), columns(heads(k), dk)
    gc = columns(g.astype(decay_dtype) if per_channel else g.astype(decay_dtype)[..., None], dk if per_channel else 1)
    bc = columns(beta.astype(jnp.float32)[..., None], 1)
    vr = v.reshape(b, nj, hb, dv)
    gw = gc.shape[2]
    col = lambda width: pl.BlockSpec((1, 1, width, hb), lambda i, j, idx: (i, j, 0, 0))
    rows = pl.BlockSpec((1, 1, hb, dv), lambda i, j, idx: (i, j, 0, 0))
    # the stack stays in HBM (constrained there), moved block by block by the kernel's own copies: left to
    # XLA, a small batch's whole stack went to VMEM and back around every layer's call
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    acc = stack.dtype
    one = jax.ShapeDtypeStruct(stack.shape[1:], acc)  # the entry read and written
    cost = pallas.cost(6 * b * hv * dk * dv, b * hv * gw, [qc, kc, gc, bc, vr, one, one, vr])
    o, stack = pl.pallas_call(
        functools.partial(_kernel, heads=hb, tiles=nj, scale=scale, acc=acc),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, nj),
            in_specs=[col(dk), col(dk), col(gw), col(1), rows, hbm], out_specs=[rows, hbm],
            scratch_shapes=[pltpu.VMEM((2, hb, dk, dv), acc), pltpu.VMEM((2, hb, dk, dv), acc),
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(vr.shape, q.dtype), jax.ShapeDtypeStruct(stack.shape, acc)],
        input_output_aliases={6: 1},  # the stack (after the index) is the second output
        # each step prefetches the next step's states: the steps run in order
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=tpu_interpreter() if interpret else False,
        cost_estimate=cost,
    )(index.reshape(1), qc, kc, gc, bc, vr,
      stack if interpret else pltpu.with_memory_space_constraint(stack, pltpu.HBM))
    return o.reshape(b, 1, hv, dv), stack


def _kernel(idx_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, s_hbm, o_ref, s_out_hbm, s_in, s_new, read, write, *,
            heads: int, tiles: int, scale: float, acc):
    """One row's tile of heads: every head's state read once, stepped in
    `acc`, written once. The states are double-buffered by hand: step n
    reads step n + 1's block while it computes, and writes its own while
    step n + 1 computes."""
    n = pl.program_id(0) * tiles + pl.program_id(1)
    last = pl.num_programs(0) * tiles - 1
    # n >= 0: lax's division, without jnp's sign fix-ups (Mosaic lowers those per chip)
    slot = jax.lax.rem(n, jnp.int32(2))

    def block(ref, m):  # step m's heads of the stack's entry
        row, tile = jax.lax.div(m, jnp.int32(tiles)), jax.lax.rem(m, jnp.int32(tiles))
        return ref.at[idx_ref[0], row, pl.ds(tile * heads, heads)]

    def fetch(m, into):
        return pltpu.make_async_copy(block(s_hbm, m), s_in.at[into], read.at[into])

    def store(m, frm):
        return pltpu.make_async_copy(s_new.at[frm], block(s_out_hbm, m), write.at[frm])

    @pl.when(n == 0)
    def _():
        fetch(n, slot).start()

    @pl.when(n < last)
    def _():
        fetch(n + 1, 1 - slot).start()

    fetch(n, slot).wait()

    @pl.when(n >= 2)  # this slot's write from two steps back is done before the slot is written again
    def _():
        store(n - 2, slot).wait()

    q = q_ref[0, 0].astype(acc)        # [K, hb]
    k = k_ref[0, 0].astype(acc)
    decay = jnp.exp(g_ref[0, 0]).astype(acc)  # [1 or K, hb]
    beta = beta_ref[0, 0].astype(acc)  # [1, hb]
    v = v_ref[0, 0].astype(acc)        # [hb, V]
    for h in range(heads):
        kh = k[:, h:h + 1]                                   # [K, 1]
        s = s_in[slot, h] * decay[:, h:h + 1]                # [K, V]
        pred = jnp.sum(kh * s, axis=0, keepdims=True)        # [1, V]
        delta = beta[:, h:h + 1] * (v[h:h + 1] - pred)
        s = s + kh * delta
        o_ref[0, 0, h:h + 1] = (scale * jnp.sum(q[:, h:h + 1] * s, axis=0, keepdims=True)).astype(o_ref.dtype)
        s_new[slot, h] = s
    store(n, slot).start()

    @pl.when(n == last)
    def _():
        store(n, slot).wait()

    @pl.when((n == last) & (n >= 1))
    def _():
        store(n - 1, 1 - slot).wait()
