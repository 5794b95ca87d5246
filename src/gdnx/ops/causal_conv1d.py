"""Depthwise causal 1-D convolution with SiLU, decoupled from the delta rule.

    y_t[d] = act( sum_{i < W} weight[d, i] * x_{t - W + 1 + i}[d] + bias[d] )

x is [B, T, D] (channels last), weight [D, W], bias [D] or None. Inputs
before a sequence's first token come from its conv state [N, D, W - 1] (the
last W - 1 inputs seen, oldest first), zeros when none is given. With
cu_seqlens (B = 1) each packed sequence starts from its own state and never
sees the previous sequence's tokens.

Rows of one sequence each take the conv as W shifted slices of the input
padded with its state. Packed sequences gather every token's window of W
inputs once (index arithmetic on the packed layout). Both backwards are
written out: dweight and dbias are sums over tokens; dx and d(state) are the
shifted cotangents summed (rows) or the windows' cotangents scattered back
(packed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdnx.ops.checks import check_cu_seqlens

ACTIVATIONS = ("silu", None)


def _window_index(batch, length, width, cu_seqlens):
    """Index [R, T, W] of every token's window into the flat rows
    concat(states [N * (W - 1)], tokens [R * T]), and the index [N, W - 1] of
    each sequence's final state in the same rows."""
    hist = width - 1
    if cu_seqlens is None:
        n = batch
        starts = jnp.arange(batch, dtype=jnp.int32) * length
        lens = jnp.full((batch,), length, jnp.int32)
        tok = jnp.arange(batch * length, dtype=jnp.int32).reshape(batch, length)
        seq = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, length))
    else:
        cu = cu_seqlens.astype(jnp.int32)
        n = cu.shape[0] - 1
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
        tok = jnp.arange(length, dtype=jnp.int32)[None]
        seq = jnp.searchsorted(cu, tok, side="right").astype(jnp.int32) - 1
    pos = tok - starts[seq]                                  # position inside the sequence
    lag = hist - jnp.arange(width, dtype=jnp.int32)          # W-1, ..., 0
    src = pos[..., None] - lag                               # [R, T, W] position of each input
    in_state = seq[..., None] * hist + hist + src            # state slot when src < 0
    index = jnp.where(src >= 0, n * hist + tok[..., None] - lag, in_state)
    # final state: the last W - 1 positions of each sequence (from the state when shorter)
    fsrc = lens[:, None] - hist + jnp.arange(hist, dtype=jnp.int32)[None]
    final = jnp.where(fsrc >= 0, n * hist + starts[:, None] + fsrc,
                      jnp.arange(n, dtype=jnp.int32)[:, None] * hist + hist + fsrc)
    return index, final


def _act(z, activation):
    return jax.nn.silu(z) if activation == "silu" else z


def _pre_activation_grad(dy, z, activation):
    """The cotangent of z = the activation's input, from the output's dy."""
    return dy * jax.grad(lambda u: jnp.sum(_act(u, activation)))(z) if activation else dy


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _conv(x, weight, bias, state, index, activation):
    return _conv_fwd(x, weight, bias, state, index, activation)[0]


def _acc(x):
    """Accumulation dtype: at least float32."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _flat(x, state):
    d = x.shape[-1]
    acc = _acc(x)
    return jnp.concatenate([jnp.swapaxes(state, 1, 2).reshape(-1, d).astype(acc), x.reshape(-1, d).astype(acc)])


def _window_sum(windows, weight, bias):
    acc = windows.dtype
    return jnp.einsum("rtwd,dw->rtd", windows, weight.astype(acc), precision=jax.lax.Precision.HIGHEST) + \
        bias.astype(acc)


def _conv_fwd(x, weight, bias, state, index, activation):
    windows = _flat(x, state)[index]                         # [R, T, W, D]
    # the inputs only, as the shifted-slice form keeps: the pre-activation is formed again in the backward when
    # an activation needs it (none does for packed rows, whose SiLU follows the cross-document terms)
    return _act(_window_sum(windows, weight, bias), activation).astype(x.dtype), (x, weight, bias, state, index)


def _conv_bwd(activation, res, dy):
    x, weight, bias, state, index = res
    acc = _acc(x)
    windows = _flat(x, state)[index]
    dz = _pre_activation_grad(dy.astype(acc), _window_sum(windows, weight, bias) if activation else None,
                              activation)
    dweight = jnp.einsum("rtwd,rtd->dw", windows, dz, precision=jax.lax.Precision.HIGHEST)
    dbias = dz.sum((0, 1))
    dwin = dz[:, :, None, :] * weight.astype(acc).T[None, None]
    dflat = jnp.zeros((state.shape[0] * state.shape[2] + x.shape[0] * x.shape[1], x.shape[-1]), acc)
    dflat = dflat.at[index.reshape(-1)].add(dwin.reshape(-1, x.shape[-1]))
    nh = state.shape[0] * state.shape[2]
    dstate = jnp.swapaxes(dflat[:nh].reshape(state.shape[0], state.shape[2], -1), 1, 2)
    dx = dflat[nh:].reshape(x.shape)
    return (dx.astype(x.dtype), dweight.astype(weight.dtype), dbias.astype(bias.dtype), dstate.astype(state.dtype),
            None)


_conv.defvjp(_conv_fwd, _conv_bwd)


# Rows without packed sequences take the conv as W shifted slices of the
# state-padded input: no gather of [B, T, W, D] windows forward and no
# scatter-add backward (on a TPU v5e, [1, 4096, 8192] bfloat16, forward and
# backward 4.0 ms against 23.1 ms for the windows). Each output is the
# windows' W products, summed in lag order, in float32 or wider.
def _padded(x, state):
    """concat(state, x) over time: [B, W - 1 + T, D] in the wider of their
    dtypes (each product takes its slice to the accumulation dtype, so no
    float32 copy of a bfloat16 input is made)."""
    dtype = jnp.promote_types(x.dtype, state.dtype)
    return jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(dtype), x.astype(dtype)], axis=1)


def _shift_sum(xx, weight, bias, t):
    acc = _acc(xx)
    z = xx[:, :t].astype(acc) * weight[:, 0].astype(acc)
    for j in range(1, weight.shape[1]):
        z = z + xx[:, j:j + t].astype(acc) * weight[:, j].astype(acc)
    return z + bias.astype(acc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _shift_conv(x, weight, bias, state, activation):
    return _shift_conv_fwd(x, weight, bias, state, activation)[0]


def _shift_conv_fwd(x, weight, bias, state, activation):
    z = _shift_sum(_padded(x, state), weight, bias, x.shape[1])
    # the inputs only: the pre-activation is W products a token, cheaper to
    # form again in the backward than to keep in float32 ([T, D] float32 a
    # layer: 0.75 GiB at T=32768, D=6144)
    return _act(z, activation).astype(x.dtype), (x, weight, bias, state)


def _shift_conv_bwd(activation, res, dy):
    x, weight, bias, state = res
    acc = _acc(x)
    t, hist = x.shape[1], weight.shape[1] - 1
    xx = _padded(x, state)
    dz = _pre_activation_grad(dy.astype(acc), _shift_sum(xx, weight, bias, t), activation)
    wf = weight.astype(acc)
    dweight = jnp.stack([jnp.sum(xx[:, j:j + t].astype(acc) * dz, axis=(0, 1)) for j in range(hist + 1)], axis=1)
    dxx = sum(jnp.pad(dz * wf[:, j], ((0, 0), (j, hist - j), (0, 0))) for j in range(hist + 1))
    dstate = jnp.swapaxes(dxx[:, :hist], 1, 2)
    return (dxx[:, hist:].astype(x.dtype), dweight.astype(weight.dtype), dz.sum((0, 1)).astype(bias.dtype),
            dstate.astype(state.dtype))


_shift_conv.defvjp(_shift_conv_fwd, _shift_conv_bwd)


def _check(x, weight, bias, activation):
    for name, arr, rank in (("x", x, 3), ("weight", weight, 2)):
        if not hasattr(arr, "shape") or not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating array")
        if arr.ndim != rank:
            raise ValueError(f"{name}: expected rank {rank}, got shape {tuple(arr.shape)}")
    d, w = weight.shape
    if x.shape[-1] != d:
        raise ValueError(f"weight: expected [D={x.shape[-1]}, W], got {tuple(weight.shape)}")
    if w < 2:
        raise ValueError(f"weight: kernel width W must be >= 2, got {w}")
    if bias is not None and tuple(bias.shape) != (d,):
        raise ValueError(f"bias: expected [D={d}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                  initial_state: jax.Array | None = None, output_final_state: bool = False,
                  cu_seqlens: jax.Array | None = None, activation: str | None = "silu",
                  ) -> tuple[jax.Array, jax.Array | None]:
    """Depthwise causal conv over [B, T, D] with SiLU (or none).

    Returns (y [B, T, D] in x's dtype, final conv state [N, D, W - 1] or None),
    N = B, or len(cu_seqlens) - 1 for packed sequences (B must be 1).
    """
    _check(x, weight, bias, activation)
    b, t, d = x.shape
    hist = weight.shape[1] - 1
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, b, t)
        cu_seqlens = jnp.asarray(cu_seqlens)
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = jnp.zeros((n, d, hist), x.dtype)
    elif not hasattr(initial_state, "shape") or not jnp.issubdtype(initial_state.dtype, jnp.floating):
        raise TypeError("initial_state: expected a floating array [N, D, W - 1]")
    elif tuple(initial_state.shape) != (n, d, hist):
        raise ValueError(f"initial_state: expected [N, D, W - 1] = {(n, d, hist)}, got {tuple(initial_state.shape)}")
    bias = jnp.zeros((d,), weight.dtype) if bias is None else bias
    if cu_seqlens is None:
        y = _shift_conv(x, weight, bias, initial_state, activation)
        if not output_final_state:
            return y, None
        # exact: the last W - 1 inputs (the state's when T < W - 1), copies in the wider dtype
        return y, jnp.swapaxes(_padded(x[:, -hist:], initial_state)[:, -hist:], 1, 2).astype(x.dtype)
    index, final_index = _window_index(b, t, weight.shape[1], cu_seqlens)
    y = _conv(x, weight, bias, initial_state, index, activation)
    if not output_final_state:
        return y, None
    # exact: the rows are upcast copies of x and the state
    return y, jnp.swapaxes(_flat(x, initial_state)[final_index], 1, 2).astype(x.dtype)


def causal_conv1d_update(x: jax.Array, conv_state: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                         activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """One decode step: x [B, D], conv_state [B, D, W - 1] -> (y [B, D], new state)."""
    y, state = causal_conv1d(x[:, None], weight, bias, initial_state=conv_state, output_final_state=True,
                             activation=activation)
    assert state is not None  # asked for
    return y[:, 0], state


def cross_document_terms(x: jax.Array, weight: jax.Array, starts: jax.Array) -> jax.Array:
    """What a causal conv's window takes from before each token's document:
    sum over lags L < W of weight[:, W - 1 - L] x_{t - L} where a document
    starts in (t - L, t]. x [B, T, D], weight [D, W], starts bool [B, T]."""
    width = weight.shape[1]
    count = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    out = jnp.zeros_like(x)
    for lag in range(1, width):
        earlier = jnp.pad(count, ((0, 0), (lag, 0)))[:, :-lag]
        crossed = (count - earlier > 0)[..., None]
        shifted = jnp.pad(x, ((0, 0), (lag, 0), (0, 0)))[:, :-lag]
        out = out + jnp.where(crossed, shifted * weight[:, width - 1 - lag].astype(x.dtype), 0)
    return out
