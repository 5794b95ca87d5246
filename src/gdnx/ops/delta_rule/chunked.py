"""What every chunked implementation shares: the chunk block layout and
the one custom VJP they all run behind (backend.py has the contract of the
forward and backward a chunked `Backend` gives).

flags are the plan's `ChunkFlags`, int32 [NC, R] (kernels take no bool
arrays); states the incoming state of every chunk, tinv the chunk inverses.
Every backend takes the same l2norm contract: q and k come raw, the backend
normalises them itself when opts.use_qk_l2norm, and its dq, dk are with
respect to the normalised q, k (this module chains them through l2norm). A
backend never visits an empty packed sequence; this module passes h0 to its
final state and the final state's cotangent back to h0.

Residual policy: "save" keeps states and tinv from the forward (named
gdn_chunk_states and gdn_chunk_inverse for remat policies); "recompute"
keeps only the inputs and reruns the forward in the backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gdnx.ops.delta_rule import primitives
from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.layout import ChunkPlan, from_slots, make_plan, to_slots
from gdnx.ops.delta_rule.options import DEFAULTS, RESIDUAL_NAMES, ResidualPolicy
from gdnx.ops.delta_rule.variant import Gate


class ChunkOptions(NamedTuple):
    """Static settings of one call (hashable: custom_vjp's nondiff argument)."""

    scale: float
    state_dtype: jnp.dtype          # the state and every accumulation
    decay_dtype: jnp.dtype          # gate sums and decay factors
    residuals: ResidualPolicy = DEFAULTS.residuals
    matmul_dtype: jnp.dtype | jax.lax.DotAlgorithmPreset | None = None  # see primitives.dot
    use_qk_l2norm: bool = False     # normalise q, k inside
    batched: bool = False           # no cu_seqlens: row r is sequence r, its states h0[r] and final[r]

    def keys(self, x):
        """q or k of a chunk in the accumulation dtype, normalised when l2norm."""
        x = x.astype(self.state_dtype)
        return primitives.l2norm(x) if self.use_qk_l2norm else x

    def algebra(self) -> dict:
        """Keyword arguments of a Variant's value-head functions."""
        return dict(scale=self.scale, decay_dtype=self.decay_dtype, matmul_dtype=self.matmul_dtype)


class ChunkFlags(NamedTuple):
    """Per-chunk flags of the chunk plan, int32 [NC, R]."""

    reset: jax.Array  # != 0: the chunk starts its sequence; its incoming state is h0[seq]
    seq: jax.Array    # the chunk's sequence
    last: jax.Array   # != 0: the chunk ends its sequence; its outgoing state is final[seq]


def select(mask, a, b):
    """where(mask, a, b) with mask broadcast from the leading dims."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim)), a, b)


def save_residuals(states, tinv):
    """Name the saved residuals so a remat policy can keep, drop or offload them."""
    return checkpoint_name(states, RESIDUAL_NAMES[0]), checkpoint_name(tinv, RESIDUAL_NAMES[1])


def finite_gates(g, decay_dtype):
    """g with every gate below a floor raised to it: -inf (a decay of exactly
    zero) and finite gates whose chunk sums would pass the dtype's range. The
    floor's exp is 0, as theirs is, so the op is unchanged; a chunk's sum of
    floors stays finite (chunks of at most 128 tokens), so the segment sums,
    0/1 matrices times g, never meet 0 x -inf. Gates below it get no gradient
    (exp of them is 0 in any float dtype)."""
    floor = max(float(jnp.finfo(g.dtype).min), float(jnp.finfo(decay_dtype).min)) / 256
    return jnp.maximum(g, jnp.asarray(floor, g.dtype))


def to_blocks(q, k, v, g, beta, plan: ChunkPlan, gate: Gate,
              tokens: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """[R, T, H, D] inputs -> [NC, R, HK, (G,) C, D] chunk blocks; a gate per
    head [R, T, HV] becomes rows [NC, R, HK, G, 1, C], a gate per channel
    [R, T, HV, K] blocks [NC, R, HK, G, C, K].

    tokens: q, k, v and a gate per channel stay in the tokens' own layout,
    as slots [R, NC*C, H, D] (a copy only where sequences are packed or the
    last chunk is ragged); a gate per head and beta still become rows."""
    r, _, hk, k_dim = q.shape
    hv = v.shape[2]
    grp = hv // hk
    nc, c = plan.num_chunks, plan.chunk

    def qk_blocks(x):
        return to_slots(x, plan).reshape(r, nc, c, hk, k_dim).transpose(1, 0, 3, 2, 4)

    def value_blocks(x):
        return to_slots(x, plan).reshape(r, nc, c, hk, grp, x.shape[-1]).transpose(1, 0, 3, 4, 2, 5)

    def gate_blocks(x):  # rows [1, C], as the chunk algebra takes them
        return to_slots(x, plan).reshape(r, nc, c, hk, grp).transpose(1, 0, 3, 4, 2)[..., None, :]

    if tokens:
        qk_blocks = value_blocks = functools.partial(to_slots, plan=plan)
    # a gate per channel is laid out as the values: [C, K] blocks
    gb = value_blocks(g) if gate == "channel" else gate_blocks(g)
    return qk_blocks(q), qk_blocks(k), value_blocks(v), gb, gate_blocks(beta)


def from_blocks(o, plan: ChunkPlan, tokens: bool = False):
    """[NC, R, HK, G, C, V] (tokens: slots [R, NC*C, HV, V]) -> [R, T, HV, V]."""
    if tokens:
        return from_slots(o, plan)
    nc, r, hk, grp, c, dv = o.shape
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(r, nc * c, hk * grp, dv)
    return from_slots(o, plan)


# How a backend argument or result is laid out, for the batch-folding rule:
# chunk blocks with rows on axis 1, per-sequence states or token slots with
# rows on axis 0, or the flags (rows on axis 1; the sequence flag holds
# indices into the sequences).
ROWS, SEQS, TOKENS, FLAG, SEQ_FLAG = "rows", "seqs", "tokens", "flag", "seq_flag"
FLAGS = (FLAG, SEQ_FLAG, FLAG)


def layout_kinds(backend: Backend) -> tuple[tuple[str, ...], ...]:
    """(forward args, forward outs, backward args, backward outs) kinds of a
    chunked backend."""
    assert backend.variant is not None  # chunked
    data = TOKENS if backend.token_layout else ROWS
    inputs = (data, data, data, data if backend.variant.gate == "channel" else ROWS, ROWS)
    return (inputs + (SEQS,) + FLAGS, (data, SEQS, ROWS, ROWS),
            inputs + (ROWS, ROWS, data, SEQS) + FLAGS, inputs + (SEQS,))


def fold_batch(fn, arg_kinds, out_kinds):
    """fn(*arrays) with a vmap rule that folds the mapped axis into the rows
    (and the sequences), so one kernel launch serves the whole batch."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return tuple(fn(*args))

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape) for x, b in zip(args, in_batched)]
        nseq = next(x.shape[1] for x, kind in zip(args, arg_kinds) if kind == SEQS)

        def fold(x, kind):
            if kind in (SEQS, TOKENS):
                return x.reshape((-1,) + x.shape[2:])
            if kind == SEQ_FLAG:
                x = x + (jnp.arange(axis_size, dtype=x.dtype) * nseq).reshape((-1,) + (1,) * (x.ndim - 1))
            x = jnp.moveaxis(x, 0, 1)
            return x.reshape(x.shape[:1] + (-1,) + x.shape[3:])

        def unfold(y, kind):
            if kind in (SEQS, TOKENS):
                return y.reshape((axis_size, -1) + y.shape[1:])
            return jnp.moveaxis(y.reshape(y.shape[:1] + (axis_size, -1) + y.shape[2:]), 1, 0)

        outs = call(*(fold(x, kind) for x, kind in zip(args, arg_kinds)))
        return tuple(unfold(y, kind) for y, kind in zip(outs, out_kinds)), (True,) * len(outs)

    return call


def _flags(plan: ChunkPlan) -> ChunkFlags:
    return ChunkFlags(*(f.astype(jnp.int32) for f in (plan.reset, plan.seq, plan.last)))


def _forward(backend: Backend, q, k, v, g, beta, h0, flags: ChunkFlags, nonempty, opts: ChunkOptions, save: bool):
    def fn(*args):
        return backend.forward(*args[:6], ChunkFlags(*args[6:]), opts=opts, save_residuals=save)

    if backend.fold_batch:
        kinds = layout_kinds(backend)
        fn = fold_batch(fn, kinds[0], kinds[1])
    out = fn(q, k, v, g, beta, h0, *flags)
    # A backend never visits an empty packed sequence: its final state is h0.
    return (out[0], select(nonempty, out[1], h0)) + tuple(out[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _chunk_scan(q, k, v, g, beta, h0, flags: ChunkFlags, nonempty, backend: Backend, opts: ChunkOptions):
    return _forward(backend, q, k, v, g, beta, h0, flags, nonempty, opts, False)


def _chunk_scan_fwd(q, k, v, g, beta, h0, flags: ChunkFlags, nonempty, backend: Backend, opts: ChunkOptions):
    save = opts.residuals == "save"
    o, final, *saved = _forward(backend, q, k, v, g, beta, h0, flags, nonempty, opts, save)
    return (o, final), (q, k, v, g, beta, flags, nonempty, save_residuals(*saved) if save else (h0,))


def _chunk_scan_bwd(backend: Backend, opts: ChunkOptions, res, cts):
    q, k, v, g, beta, flags, nonempty, saved = res
    if opts.residuals == "recompute":
        _, _, *saved = _forward(backend, q, k, v, g, beta, saved[0], flags, nonempty, opts, True)
    states, tinv = saved
    do, dfinal = cts

    def fn(*args):
        return backend.backward(*args[:9], ChunkFlags(*args[9:]), opts=opts)

    if backend.fold_batch:
        kinds = layout_kinds(backend)
        fn = fold_batch(fn, kinds[2], kinds[3])
    dq, dk, dv, dg, dbeta, dh0 = fn(q, k, v, g, beta, tinv, states, do, dfinal, *flags)
    if opts.use_qk_l2norm:
        def l2(a, b):
            return primitives.l2norm(a.astype(opts.state_dtype)), primitives.l2norm(b.astype(opts.state_dtype))

        dq, dk = jax.vjp(l2, q, k)[1]((dq.astype(opts.state_dtype), dk.astype(opts.state_dtype)))
    # An empty packed sequence passes h0 straight to its final state.
    dh0 = select(nonempty, dh0, dfinal.astype(dh0.dtype))
    grads = (dq, dk, dv, dg, dbeta)
    return tuple(d.astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta))) + (dh0, None, None)


_chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)


def run(backend: Backend, q, k, v, g, beta, h0, *, cu_seqlens, chunk_size: int, scale: float, state_dtype,
        decay_dtype, use_qk_l2norm: bool, residuals: ResidualPolicy = DEFAULTS.residuals, matmul_dtype=None,
        hand_written_vjp: bool = True, chunk_states: bool = False, **knobs):
    """Validated [B, T, H, D] inputs in, (o [B, T, HV, V], final [N, HV, K, V]) out.

    knobs go to the backend's forward and backward (a kernel's interpret
    and tiles).

    chunk_states=True (no cu_seqlens; forward only, not differentiable)
    returns a third result, the state after every chunk [B, NC, HV, K, V]:
    the incoming states every chunked backend saves for its backward, shifted
    by one, and the final state (the last chunk's zero padding is inert).

    hand_written_vjp=False differentiates the backend's forward with plain
    autodiff (only for a backend written in plain JAX: the baseline the
    gradient tests and benchmarks compare with).
    """
    if backend.check_shapes is not None:
        backend.check_shapes(q.shape[-1], v.shape[-1])
    if knobs:
        assert backend.forward is not None and backend.backward is not None  # chunked
        backend = dataclasses.replace(backend, forward=functools.partial(backend.forward, **knobs),
                                      backward=functools.partial(backend.backward, **knobs))
    opts = ChunkOptions(scale=scale, state_dtype=jnp.dtype(state_dtype), decay_dtype=jnp.dtype(decay_dtype),
                        residuals=residuals, matmul_dtype=matmul_dtype, use_qk_l2norm=use_qk_l2norm,
                        batched=cu_seqlens is None)
    r, t, hk, k_dim = q.shape
    hv, v_dim = v.shape[2], v.shape[3]
    plan = make_plan(r, t, chunk_size, cu_seqlens)
    # The VJP returns dh0 in the accumulation dtype, so h0 comes in in it.
    h0b = h0.astype(opts.state_dtype).reshape(h0.shape[0], hk, hv // hk, k_dim, v_dim)
    flags = _flags(plan)
    assert backend.variant is not None  # chunked
    tokens = backend.token_layout
    blocks = to_blocks(q, k, v, finite_gates(g, opts.decay_dtype), beta, plan, backend.variant.gate, tokens)
    if chunk_states:
        assert cu_seqlens is None  # checked by the public op
        o, final, states, _ = _forward(backend, *blocks, jax.lax.stop_gradient(h0b), flags, plan.nonempty, opts,
                                       True)
        after = jnp.concatenate([states[1:], final[None]], axis=0)  # [NC, R, HK, G, K, V]
        after = jnp.moveaxis(after, 0, 1).reshape(r, plan.num_chunks, hv, k_dim, v_dim)
        return from_blocks(o, plan, tokens), final.reshape(h0.shape), after
    if hand_written_vjp:
        o, final = _chunk_scan(*blocks, h0b, flags, plan.nonempty, backend, opts)
    else:
        o, final = _forward(backend, *blocks, h0b, flags, plan.nonempty, opts, False)
    return from_blocks(o, plan, tokens), final.reshape(h0.shape)
