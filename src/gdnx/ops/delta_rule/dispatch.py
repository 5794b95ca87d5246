"""What every delta-rule op does around its implementations: the argument
checks, the settings (`DeltaRuleOptions` or keywords), the choice of
implementation from the op's table, and one jitted call of it.

An op package (gated_delta_rule, kda) gives its Variant, its table of
implementations and its public signature; `call` does the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gdnx.ops.checks import check_cu_seqlens, float_dtype
from gdnx.ops.delta_rule import chunked, pallas, pallas_tpu, primitives, reference, xla
from gdnx.ops.delta_rule.backend import Backend
from gdnx.ops.delta_rule.options import (
    CHUNK_SIZES,
    DEFAULTS,
    RESIDUAL_POLICIES,
    DeltaRuleOptions,
    Implementation,
)
from gdnx.ops.delta_rule.tiles import GpuTiles, TpuTiles, choose_tiles, target_platform
from gdnx.ops.delta_rule.variant import Variant


@dataclasses.dataclass(frozen=True)
class Gate:
    """A gate function the op applies to g inside its jitted call:
    g = fn(raw g, *arrays, dtype=decay_dtype, **dict(static))."""

    fn: Callable  # a module-level function: the jitted call's cache key
    arrays: tuple
    static: tuple[tuple[str, Any], ...] = ()


def implementations(variant: Variant, pallas_gpu: Backend) -> dict[str, Backend]:
    """An op's table: the shared implementations over its Variant (xla,
    pallas_tpu), its own Triton kernels and the token recurrence."""
    assert pallas_gpu.variant is variant, "the GPU kernels run the op's own chunk algebra"
    return {b.name: b for b in (xla.backend(variant), pallas_tpu.backend(variant), pallas_gpu, reference.BACKEND)}


def default_implementation(table: Mapping[str, Backend], platform: str | None = None) -> str:
    """The implementation `implementation=None` picks from an op's table: the
    kernel written for the platform (pallas_tpu on TPU, pallas_gpu on GPU)
    where the op has one, xla elsewhere (the CPU); the platform is the one
    programs are traced for (tiles.target_platform)."""
    auto = {b.platform: b.name for b in table.values() if b.platform}
    return auto.get(platform or target_platform(), "xla")


def _resolve_dtype(name: str, value: DTypeLike | str) -> np.dtype:
    try:
        return float_dtype(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _products(matmul_dtype, q, kernel: bool, state_dtype) -> np.dtype | None:
    """The dtype the chunked algebra rounds matmul operands to (None: none,
    products in state_dtype). Unset: for the Pallas kernels, bfloat16 when
    the inputs are (one tensor-core / MXU pass, float32 accumulation, as the
    hardware the kernels are for runs fastest); otherwise none (the xla
    implementation is CPU's default, and XLA:CPU cannot run some bfloat16 x
    bfloat16 -> float32 products). Set to state_dtype: none, whatever the
    inputs."""
    if matmul_dtype is None:
        bf16 = kernel and hasattr(q, "dtype") and q.dtype == jnp.bfloat16
        return np.dtype(jnp.bfloat16) if bf16 else None
    resolved = _resolve_dtype("matmul_dtype", matmul_dtype)
    return None if resolved == _resolve_dtype("state_dtype", state_dtype) else resolved


def _check_float_array(name: str, x, ndim: int, layout: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array {layout}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected rank {ndim} {layout}, got shape {tuple(x.shape)}")


# the op that takes the other gate shape, named when g has it
_OTHER_GATE = {"channel": "a per-head gate [B, T, HV] is chunk_gated_delta_rule's",
               "head": "a per-channel gate [B, T, HV, K] is chunk_kda's"}


def _check_gate(g, variant: Variant, shape: tuple[int, ...]):
    """g as the variant's gate: [B, T, HV] (per head) or [B, T, HV, K] (per
    key channel), with a pointer to the other op when it has the other shape."""
    want = variant.gate_layout()
    ndim = getattr(g, "ndim", None)
    _check_float_array("g", g, ndim if ndim in (3, 4) else len(shape), want)
    if g.ndim != len(shape):
        raise ValueError(f"g: expected {want} = {shape}, got shape {tuple(g.shape)}; {_OTHER_GATE[variant.gate]}")
    if g.shape != shape:
        what = " (its last dimension must be K, the key head dim)" if variant.gate == "channel" else ""
        raise ValueError(f"g: expected {want} = {shape}{what}, got {tuple(g.shape)}")


def _validate(variant: Variant, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
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
    _check_gate(g, variant, (b, t, hv, k_dim) if variant.gate == "channel" else (b, t, hv))
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
    return primitives.l2norm(x.astype(jnp.promote_types(x.dtype, jnp.float32))).astype(x.dtype)


def call(variant: Variant, table: Mapping[str, Backend], allowed: tuple[Implementation, ...], op: str,
         opts: DeltaRuleOptions, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
         scale: float | None, initial_state: jax.Array | None, output_final_state: bool,
         cu_seqlens: jax.Array | None, use_qk_l2norm: bool, tiles: GpuTiles | TpuTiles | None,
         history: str | None = None, gate: Gate | None = None,
         ) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Check the arguments of `op`, `variant`'s op whose implementations are
    `table` (those it takes here `allowed`), and run the implementation
    `opts` names, jitted. history: None, or "chunks" / "tokens" to also
    return the state after every chunk / token. gate: None, or a `Gate`
    function with its parameters that turns g (then the gate's raw input)
    into the log decay inside the jitted op."""
    name = opts.implementation or default_implementation(table)
    if name not in allowed:
        raise ValueError(f"implementation: expected None or one of {sorted(allowed)} for {op}, got {name!r}")
    impl = table[name]
    knobs: dict[str, Any] = {"use_qk_l2norm": use_qk_l2norm}
    if impl.kernel:
        if opts.interpret is not None and not isinstance(opts.interpret, bool):
            raise TypeError(f"interpret: expected None or a bool, got {type(opts.interpret).__name__}")
        knobs.update(interpret=pallas.resolve_interpret(opts.interpret),
                     tiles=choose_tiles(name, tiles, key_heads=q.shape[2]))
    else:
        kernels = sorted(n for n, i in table.items() if i.kernel)
        for what, x in (("interpret", opts.interpret), ("tiles", tiles)):
            if x is not None:
                raise ValueError(f"{what}: applies to the Pallas implementations {kernels}, not to {name!r}")
    policies = impl.residual_policies if impl.chunked else RESIDUAL_POLICIES
    if opts.residuals not in policies:
        raise ValueError(f"residuals: expected one of {policies}, got {opts.residuals!r}")
    matmul_dtype = _products(opts.matmul_dtype, q, impl.kernel, opts.state_dtype)
    if impl.chunked:
        knobs.update(chunk_size=opts.chunk_size, residuals=opts.residuals, matmul_dtype=matmul_dtype)
    elif history == "chunks":  # the token recurrence's states, taken at the chunk ends
        knobs.update(chunk_size=opts.chunk_size)
    elif opts.residuals != DEFAULTS.residuals or matmul_dtype is not None:
        what = "residuals" if opts.residuals != DEFAULTS.residuals else "matmul_dtype"
        chunked = sorted(n for n, i in table.items() if i.chunked)
        raise ValueError(f"{what}: applies to the chunked implementations {chunked}, not to {name!r}")
    n = _validate(variant, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)
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
    o, final, states = _dispatch(q, k, v, g, beta, h0, cu, None if gate is None else gate.arrays, backend=impl,
                                 gate_fn=None if gate is None else gate.fn,
                                 gate_static=() if gate is None else gate.static, scale=scale, state_dtype=state_dtype,
                                 decay_dtype=decay_dtype, history=history, **knobs)
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


@functools.partial(jax.jit, static_argnames=("backend", "gate_fn", "gate_static", "use_qk_l2norm", "scale",
                                             "state_dtype", "decay_dtype", "chunk_size", "interpret", "tiles",
                                             "residuals", "matmul_dtype", "history"))
def _dispatch(q, k, v, g, beta, h0, cu_seqlens, gate, *, backend: Backend, gate_fn=None, gate_static=(),
              use_qk_l2norm=False, history=None, **kw):
    # Jitted so that eager callers get one compiled program, not op-by-op dispatch,
    # and so that a gate function fuses into the pass that lays out g.
    states = None
    if gate_fn is not None:
        g = gate_fn(g, *gate, dtype=kw["decay_dtype"], **dict(gate_static))
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
