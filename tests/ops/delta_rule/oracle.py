"""Float64 token-by-token oracle, written independently of gdnx.

One sequence batch at a time (packed inputs are split by the caller), value
heads read their key head by explicit repetition, l2norm by its definition.
"""

import jax
import jax.numpy as jnp
import numpy as np


def oracle(q, k, v, g, beta, h0=None, *, scale=None, use_qk_l2norm=False):
    """q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] (GDN) or [B, T, HV, K]
    (KDA), beta [B, T, HV]; h0 [B, HV, K, V].
    Returns (o [B, T, HV, V], final [B, HV, K, V]) in float64."""
    f64 = jnp.float64
    q, k, v, g, beta = (jnp.asarray(x).astype(f64) for x in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if use_qk_l2norm:
        q = q / jnp.sqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    q = jnp.repeat(q, hv // hk, axis=2)
    k = jnp.repeat(k, hv // hk, axis=2)
    scale = dk ** -0.5 if scale is None else scale
    s = jnp.zeros((b, hv, dk, dv), f64) if h0 is None else jnp.asarray(h0).astype(f64)

    def step(s, x):
        qt, kt, vt, gt, bt = x
        # a per-head decay scales the state, a per-channel one (KDA) its rows
        s = (jnp.exp(gt)[..., None, None] if gt.ndim == 2 else jnp.exp(gt)[..., None]) * s
        err = vt - jnp.einsum("bhk,bhkv->bhv", kt, s)
        s = s + jnp.einsum("bhk,bhv->bhkv", kt, bt[..., None] * err)
        return s, scale * jnp.einsum("bhk,bhkv->bhv", qt, s)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    s, o = jax.lax.scan(step, s, xs)
    return jnp.moveaxis(o, 0, 1), s


def oracle_packed(q, k, v, g, beta, h0, cu_seqlens, **kw):
    """Packed sequences ([1, T, ...] with offsets), each run on its own."""
    cu = np.asarray(cu_seqlens)
    outs, finals = [], []
    for n in range(len(cu) - 1):
        lo, hi = int(cu[n]), int(cu[n + 1])
        hn = None if h0 is None else h0[n:n + 1]
        if hi == lo:
            finals.append(jnp.zeros((1,) + v.shape[2:3] + (q.shape[3], v.shape[3]), jnp.float64) if hn is None
                          else jnp.asarray(hn, jnp.float64))
            continue
        o, f = oracle(*(x[:, lo:hi] for x in (q, k, v, g, beta)), hn, **kw)
        outs.append(o)
        finals.append(f)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(finals, axis=0)
