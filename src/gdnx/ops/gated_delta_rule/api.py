"""Public gated delta rule ops: one contract, several implementations.

Shapes (docs/ops.md has the full contract):
    q, k          [B, T, HK, K]
    v             [B, T, HV, V]        HV a multiple of HK; value head h
    g, beta       [B, T, HV]           reads key head h // (HV // HK)
    initial_state [N, HV, K, V]        N = B, or len(cu_seqlens) - 1
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gdnx.ops.checks import check_cu_seqlens, float_dtype
from gdnx.ops.gated_delta_rule import chunk_math, gates
from gdnx.ops.gated_delta_rule.options import (
    CHUNK_IMPLEMENTATIONS,
    CHUNK_SIZES,
    DEFAULTS,
    DeltaRuleOptions,
    RECURRENT_IMPLEMENTATIONS,
    RESIDUAL_POLICIES,
    Implementation,
    ResidualPolicy,
)
from gdnx.ops.gated_delta_rule import chunked, kda_pallas_gpu, pallas_common, pallas_gpu, pallas_tpu, reference, xla
from gdnx.ops.gated_delta_rule.backend import Backend
from gdnx.ops.gated_delta_rule.tiles import GpuTiles, TpuTiles, choose_tiles

# the op's table: one Backend per implementation (backend.py)
IMPLEMENTATIONS: dict[str, Backend] = {
    b.name: b for b in (xla.BACKEND, pallas_tpu.BACKEND, pallas_gpu.BACKEND, reference.BACKEND)}
# KDA's table (per-channel gates): the same names, KDA's chunk algebra behind them
KDA_IMPLEMENTATIONS: dict[str, Backend] = {
    b.name: b for b in (xla.KDA_BACKEND, pallas_tpu.KDA_BACKEND, kda_pallas_gpu.KDA_BACKEND, reference.BACKEND)}


def default_chunk_implementation(platform: str | None = None, *, per_channel: bool = False) -> str:
    """The implementation `implementation=None` picks: the kernel written
    for the platform (pallas_tpu on TPU, pallas_gpu on GPU) where the op
    has one, xla elsewhere (the CPU)."""
    table = KDA_IMPLEMENTATIONS if per_channel else IMPLEMENTATIONS
    auto = {b.platform: b.name for b in table.values() if b.platform}
    return auto.get(platform or jax.default_backend(), "xla")


def _resolve_dtype(name: str, value: DTypeLike | str) -> np.dtype:
    try:
        return float_dtype(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _check_float_array(name: str, x, ndim: int, layout: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array {layout}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected rank {ndim} {layout}, got shape {tuple(x.shape)}")


def _check_gate(g, per_channel: bool, shape: tuple[int, ...]):
    """g [B, T, HV] (per head, GDN) or [B, T, HV, K] (per key channel, KDA),
    with a pointer to the other op when it has the other one's shape."""
    want = "[B, T, HV, K]" if per_channel else "[B, T, HV]"
    ndim = getattr(g, "ndim", None)
    _check_float_array("g", g, ndim if ndim in (3, 4) else len(shape), want)
    if g.ndim != len(shape):
        other = ("a per-head gate [B, T, HV] is chunk_gated_delta_rule's" if per_channel
                 else "a per-channel gate [B, T, HV, K] is chunk_kda's")
        raise ValueError(f"g: expected {want} = {shape}, got shape {tuple(g.shape)}; {other}")
    if g.shape != shape:
        what = " (its last dimension must be K, the key head dim)" if per_channel else ""
        raise ValueError(f"g: expected {want} = {shape}{what}, got {tuple(g.shape)}")


def _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, per_channel: bool = False):
    _check_float_array("q", q, 4, "[B, T, HK, K]")
    _check_float_array("k", k, 4, "[B, T, HK, K]")
    _check_float_array("v", v, 4, "[B, T, HV, V]")
    _check_float_array("beta", beta, 3, "[B, T, HV]")
    b, t, hk, k_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (b, t):
        raise ValueError(f"v: expected [B={b}, T={t}, HV, V], got {tuple(v.shape)}")
    hv, v_dim = v.shape[2], v.shape[3]
    if t < 1:
        raise ValueError("q: expected at least one token (T >= 1), got T=0")
    if hv % hk:
        raise ValueError(f"v: value heads HV={hv} must be a multiple of key heads HK={hk}")
    _check_gate(g, per_channel, (b, t, hv, k_dim) if per_channel else (b, t, hv))
    if beta.shape != (b, t, hv):
        raise ValueError(f"beta: expected [B, T, HV] = {(b, t, hv)}, got {tuple(beta.shape)}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        raise TypeError(f"scale: expected a Python float or None, got {type(scale).__name__}")
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"use_qk_l2norm: expected a bool, got {type(use_qk_l2norm).__name__}")
    n = b
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, b, t)
        n = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        _check_float_array("initial_state", initial_state, 4, "[N, HV, K, V]")
        if initial_state.shape != (n, hv, k_dim, v_dim):
            raise ValueError(
                f"initial_state: expected [N, HV, K, V] = {(n, hv, k_dim, v_dim)}, got {tuple(initial_state.shape)}")
    return n


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum x^2 + 1e-6) over the last axis, computed in at least
    float32 and rounded back to x's dtype."""
    return chunk_math.l2norm(x.astype(jnp.promote_types(x.dtype, jnp.float32))).astype(x.dtype)


def call(allowed: tuple[Implementation, ...], op: str, opts: DeltaRuleOptions, q: jax.Array, k: jax.Array,
         v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float | None, initial_state: jax.Array | None,
         output_final_state: bool, cu_seqlens: jax.Array | None, use_qk_l2norm: bool,
         tiles: GpuTiles | TpuTiles | None, history: str | None = None, per_channel: bool = False,
         gate: gates.GateParams | None = None,
         ) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Check the arguments of `op` (whose implementations are `allowed`) and
    run the implementation `opts` names, jitted. history: None, or "chunks"
    / "tokens" to also return the state after every chunk / token.
    per_channel: g is KDA's [B, T, HV, K] (KDA's table of implementations).
    gate: None, or a `gates.GateParams` that turns g (then the gate's raw
    input) into the log decay inside the jitted op."""
    table = KDA_IMPLEMENTATIONS if per_channel else IMPLEMENTATIONS
    name = opts.implementation or default_chunk_implementation(per_channel=per_channel)
    if name not in allowed:
        raise ValueError(f"implementation: expected None or one of {sorted(allowed)} for {op}, got {name!r}")
    impl = table[name]
    knobs: dict[str, Any] = {"use_qk_l2norm": use_qk_l2norm}
    if impl.kernel:
        if opts.interpret is not None and not isinstance(opts.interpret, bool):
            raise TypeError(f"interpret: expected None or a bool, got {type(opts.interpret).__name__}")
        knobs.update(interpret=pallas_common.resolve_interpret(opts.interpret),
                     tiles=choose_tiles(name, tiles, key_heads=q.shape[2]))
    else:
        kernels = sorted(n for n, i in table.items() if i.kernel)
        for what, x in (("interpret", opts.interpret), ("tiles", tiles)):
            if x is not None:
                raise ValueError(f"{what}: applies to the Pallas implementations {kernels}, not to {name!r}")
    policies = impl.residual_policies if impl.chunked else RESIDUAL_POLICIES
    if opts.residuals not in policies:
        raise ValueError(f"residuals: expected one of {policies}, got {opts.residuals!r}")
    matmul_dtype = None if opts.matmul_dtype is None else _resolve_dtype("matmul_dtype", opts.matmul_dtype)
    if impl.chunked:
        knobs.update(chunk_size=opts.chunk_size, residuals=opts.residuals, matmul_dtype=matmul_dtype)
    elif history == "chunks":  # the token recurrence's states, taken at the chunk ends
        knobs.update(chunk_size=opts.chunk_size)
    elif opts.residuals != DEFAULTS.residuals or matmul_dtype is not None:
        what = "residuals" if opts.residuals != DEFAULTS.residuals else "matmul_dtype"
        chunked = sorted(n for n, i in table.items() if i.chunked)
        raise ValueError(f"{what}: applies to the chunked implementations {chunked}, not to {name!r}")
    n = _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, per_channel)
    state_dtype = _resolve_dtype("state_dtype", opts.state_dtype)
    decay_dtype = _resolve_dtype("decay_dtype", opts.decay_dtype)
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state: expected a bool, got {type(output_final_state).__name__}")
    if history is not None and cu_seqlens is not None:
        what = "output_chunk_states" if history == "chunks" else "output_token_states"
        raise ValueError(f"{what}: states along the sequence are for a plain batch; got cu_seqlens")
    k_dim, v_dim, hv = q.shape[3], v.shape[3], v.shape[2]
    scale = float(k_dim ** -0.5 if scale is None else scale)
    if initial_state is None:
        h0 = jnp.zeros((n, hv, k_dim, v_dim), state_dtype)
    else:
        h0 = jnp.asarray(initial_state).astype(state_dtype)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens).astype(jnp.int32)
    q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
    o, final, states = _dispatch(q, k, v, g, beta, h0, cu, None if gate is None else gate.arrays(), backend=impl,
                                 scale=scale, state_dtype=state_dtype, decay_dtype=decay_dtype, history=history,
                                 lower_bound=None if gate is None else gate.lower_bound, **knobs)
    if history is not None:
        return o, (final if output_final_state else None), states
    return o, (final if output_final_state else None)


def resolve_options(options: DeltaRuleOptions | None, **given: Any) -> DeltaRuleOptions:
    """The op's settings: `options`, or the keyword arguments (whose defaults
    are DeltaRuleOptions'), not both. A keyword at its default value counts
    as not given."""
    if options is None:
        return dataclasses.replace(DEFAULTS, **given)
    if not isinstance(options, DeltaRuleOptions):
        raise TypeError(f"options: expected a DeltaRuleOptions or None, got {type(options).__name__}")
    changed = sorted(k for k, v in given.items() if v is not getattr(DEFAULTS, k) and v != getattr(DEFAULTS, k))
    if changed:
        raise ValueError(f"options: given together with {', '.join(changed)}; set them in the DeltaRuleOptions")
    return options


def chunk_options(options: DeltaRuleOptions | None, output_chunk_states: bool, **given: Any) -> DeltaRuleOptions:
    """A chunked op's settings (`resolve_options`), its chunk size and
    output_chunk_states checked."""
    opts = resolve_options(options, **given)
    if opts.chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {opts.chunk_size!r}")
    if not isinstance(output_chunk_states, bool):
        raise TypeError(f"output_chunk_states: expected a bool, got {type(output_chunk_states).__name__}")
    return opts


def recurrent_options(implementation: Implementation | None, state_dtype: DTypeLike, decay_dtype: DTypeLike,
                      output_token_states: bool) -> DeltaRuleOptions:
    """A recurrent op's settings, output_token_states checked."""
    if not isinstance(output_token_states, bool):
        raise TypeError(f"output_token_states: expected a bool, got {type(output_token_states).__name__}")
    return DeltaRuleOptions(implementation=implementation or "reference", state_dtype=state_dtype,
                            decay_dtype=decay_dtype)


@functools.partial(jax.jit, static_argnames=("backend", "use_qk_l2norm", "scale", "state_dtype", "decay_dtype",
                                             "chunk_size", "interpret", "tiles", "residuals", "matmul_dtype",
                                             "history", "lower_bound"))
def _dispatch(q, k, v, g, beta, h0, cu_seqlens, gate, *, backend: Backend, use_qk_l2norm=False, history=None,
              lower_bound=None, **kw):
    # Jitted so that eager callers get one compiled program, not op-by-op dispatch,
    # and so that a gate function fuses into the pass that lays out g.
    states = None
    if gate is not None:
        g = gates.kda_gate(g, *gate, lower_bound=lower_bound, dtype=kw["decay_dtype"])
    if backend.chunked:
        out = chunked.run(backend, q, k, v, g, beta, h0, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                          chunk_states=history == "chunks", **kw)
        o, final, states = out if history else (*out, None)
    else:
        assert backend.run is not None
        if use_qk_l2norm:  # the token recurrence does not apply l2norm itself
            q, k = l2norm(q), l2norm(k)
        chunk = kw.pop("chunk_size", 1)
        kw = {name: kw[name] for name in ("scale", "state_dtype", "decay_dtype")}
        if history is None:
            o, final = backend.run(q, k, v, g, beta, h0, cu_seqlens=cu_seqlens, **kw)
        else:
            o, final, states = backend.run(q, k, v, g, beta, h0, cu_seqlens=cu_seqlens, token_states=True, **kw)
            if history == "chunks":  # the state after every chunk: its last token's (the last chunk may be short)
                ends = np.minimum(np.arange(chunk, -(-q.shape[1] // chunk) * chunk + 1, chunk), q.shape[1]) - 1
                states = states[:, ends]
    return o, final.astype(kw["state_dtype"]), None if states is None else states.astype(kw["state_dtype"])


def chunk_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float | None = None,
    initial_state: jax.Array | None = None, output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False, options: DeltaRuleOptions | None = None, chunk_size: int = DEFAULTS.chunk_size,
    state_dtype: DTypeLike = DEFAULTS.state_dtype, decay_dtype: DTypeLike = DEFAULTS.decay_dtype,
    implementation: Implementation | None = DEFAULTS.implementation, interpret: bool | None = DEFAULTS.interpret,
    tiles: GpuTiles | TpuTiles | None = None, residuals: ResidualPolicy = DEFAULTS.residuals,
    matmul_dtype: DTypeLike | None = DEFAULTS.matmul_dtype, output_chunk_states: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Gated delta rule over whole sequences, chunk by chunk.

    Args:
      q, k: [B, T, HK, K] queries and keys.
      v: [B, T, HV, V] values; HV is a multiple of HK and value head h reads
        key head h // (HV // HK).
      g: [B, T, HV] log decay (<= 0, not checked).
      beta: [B, T, HV] write strength in [0, 2] (above 1: negative eigenvalues
        of the transition, as OLMo-Hybrid uses; not checked, values are traced).
      scale: output scale, K ** -0.5 when None.
      initial_state: [N, HV, K, V] state before the first token of each
        sequence; zeros when None.
      output_final_state: also return the state after each sequence's last token.
      cu_seqlens: int [N + 1] offsets of N sequences packed in one row (B must
        be 1). The state starts from initial_state[n] at each start and never
        crosses a boundary. Values are checked when known at trace time.
      use_qk_l2norm: normalise q and k to unit length inside the op.
      options: the settings below as one DeltaRuleOptions (what a model
        fixes once), in place of the keywords chunk_size ... interpret.
      chunk_size: one of 16, 32, 64, 128; T need not be a multiple.
      state_dtype: dtype of the state and of every accumulation.
      decay_dtype: dtype of the gate cumulative sums and decay factors.
      implementation: None (pallas_tpu on TPU, pallas_gpu on GPU, xla on
        CPU), or one of "xla", "reference", "pallas_tpu", "pallas_gpu".
        A named implementation never falls back to another.
      interpret: Pallas implementations only. None runs the kernel in
        interpret mode exactly when the default backend is the CPU; False
        always lowers for the hardware (also from a CPU host, for
        jax.export); True always interprets.
      tiles: Pallas implementations only. None: the table's entry for the
        target device, fitted to the shapes (gdnx.ops.gated_delta_rule.tiles);
        GpuTiles or TpuTiles to choose them, checked against the shapes.
      residuals: what the backward gets from the forward (hand-written VJPs:
        xla and the kernels). "save": each chunk's incoming state and the
        chunk inverse, named gdn_chunk_states and gdn_chunk_inverse for remat
        policies; "recompute": only the inputs, and the backward reruns the
        forward pass first.
      matmul_dtype: None keeps every matmul operand in state_dtype (exact
        float32 products). A dtype such as "bfloat16" rounds the operands of
        every matmul outside the chunk inverse to it, accumulating in
        state_dtype: one bf16 MXU / tensor-core pass instead of several, at
        the accuracy cost measured in docs/ops.md.
      output_chunk_states: also return the state after every chunk
        [B, ceil(T / chunk_size), HV, K, V] (the last entry is the final
        state): what a prefix cache keeps at chunk boundaries. Forward only
        (not differentiable); no cu_seqlens. Every implementation gives it
        (the chunked ones from the states they save for their backward).

    Returns:
      (o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] in state_dtype
      or None), and the chunk states (state_dtype) when output_chunk_states.
    """
    opts = chunk_options(options, output_chunk_states, implementation=implementation, chunk_size=chunk_size,
                         state_dtype=state_dtype, decay_dtype=decay_dtype, residuals=residuals,
                         matmul_dtype=matmul_dtype, interpret=interpret)
    return call(CHUNK_IMPLEMENTATIONS, "chunk_gated_delta_rule", opts, q, k, v, g, beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm=use_qk_l2norm, tiles=tiles, history="chunks" if output_chunk_states else None)


def recurrent_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, scale: float | None = None,
    initial_state: jax.Array | None = None, output_final_state: bool = False, cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False, state_dtype: DTypeLike = DEFAULTS.state_dtype,
    decay_dtype: DTypeLike = DEFAULTS.decay_dtype, implementation: Implementation | None = None,
    output_token_states: bool = False,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Gated delta rule token by token: decode steps, and the definition.

    Same arguments and results as `chunk_gated_delta_rule`, without
    chunk_size. implementation: None or "reference". output_token_states:
    also return the state after every token [B, T, HV, K, V] (no
    cu_seqlens): what speculative decoding selects from after verifying
    draft tokens.
    """
    opts = recurrent_options(implementation, state_dtype, decay_dtype, output_token_states)
    return call(RECURRENT_IMPLEMENTATIONS, "recurrent_gated_delta_rule", opts, q, k, v, g, beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm=use_qk_l2norm, tiles=None, history="tokens" if output_token_states else None)
