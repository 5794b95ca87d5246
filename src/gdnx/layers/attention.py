"""Softmax attention with grouped key/value heads, in three forms:
`GatedAttention` (Qwen3-Next, Qwen3.5): q_proj doubled for a sigmoid output
gate, zero-centred RMSNorm on q and k per head, partial RoPE;
`NormedAttention` (OLMo Hybrid): RMSNorm on q and k across all heads, RoPE
or none, no gate; `HeadNormedAttention` (Lara 4 Mini): RMSNorm on q and k
per head, no gate, RoPE or none, and optionally a sliding window. They share
the attention and its caches: KVCache, every position at its own slot, or
for a sliding window RingCache, the last `ring` positions at slot
position % ring, so its memory stays fixed however long the context."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gdnx.layers.linear import linear
from gdnx.layers.norms import RMSNorm, ZeroCenteredRMSNorm
from gdnx.layers.rope import apply_rope
from gdnx.layers.splash import Splash
from gdnx.parallel.rules import HIDDEN, as_repeat_of, constrain, out_sharding, spec


class KVCache(NamedTuple):
    """Keys and values [B, max_len, num_key_value_heads, head_dim]."""
    k: jax.Array
    v: jax.Array

    @property
    def capacity(self) -> int:
        """Tokens the cache holds."""
        return self.k.shape[-3]


class KVStack(NamedTuple):
    """Inside a scanned cycle: the cycle's keys and values stacked over its
    repeats [R, B, max_len, ...], and the repeat `layer` a call is. The call
    writes its positions into the stack itself (a repeat's slice taken out
    and written back would copy the whole entry twice a step)."""
    k: jax.Array
    v: jax.Array
    layer: jax.Array


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                     segments: jax.Array | None = None, window: int | None = None,
                     allowed: jax.Array | None = None) -> jax.Array:
    """Softmax attention of q [B, T, H, D] over k [B, S, Hkv, D] and v
    [B, S, Hkv, Dv] (scaled by D^-1/2) where a
    key is visible when its position is <= the query's (positions [T] or
    [B, T] (each row at its own offset), and [S] or [B, S];
    cache slots not yet written carry positions past every query), with a
    window, more than query - window, with segments [B, T] (S = T:
    packed documents), in the query's document, and with allowed [B, T, S]
    (a sparse-attention index's choice), where it is true."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    # on a mesh: tensor goes to the kv-head groups when it divides them, else
    # to the query heads within a group (k and v then stay whole)
    grouped = ("batch", "length", "kv_heads", "heads", None)
    qg = jnp.reshape(q, (b, t, hkv, h // hkv, d), out_sharding=out_sharding(grouped, (b, t, hkv, h // hkv, d)))
    kv_spec = spec(grouped, qg.shape)
    kv_axes = ("batch", None, "kv_heads" if kv_spec[2] else None, None)
    k, v = constrain(k, kv_axes), constrain(v, kv_axes)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    # [T, S], or [B, T, S] for positions per row
    visible = k_pos[..., None, :] <= q_pos[..., :, None]
    if allowed is not None:
        visible = visible & allowed
    if window is not None:
        visible = visible & (k_pos[..., None, :] > q_pos[..., :, None] - window)
    if segments is not None:
        same = constrain(segments, ("batch", "length"))[:, :, None] == constrain(segments, ("batch", None))[:, None]
        visible = visible & same
    if visible.ndim == 3:
        visible = visible[:, None, None]  # [B, 1, 1, T, S] against scores [B, G, R, T, S]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v, preferred_element_type=jnp.float32)
    dv = v.shape[-1]
    return jnp.reshape(out, (b, t, h, dv), out_sharding=out_sharding(("batch", "length", "heads", None),
                                                                     (b, t, h, dv))).astype(q.dtype)


def write_cache(buf: jax.Array, x: jax.Array, start: jax.Array | int, axes: tuple[str | None, ...],
                layer: jax.Array | None = None) -> jax.Array:
    """buf [B, S, ...] with x [B, T, ...] written at [start, start + T) of
    each row: start a scalar, or [B] (each row's own); axes: buf's logical
    axes, kept on a mesh (the length stays whole: writes land at any
    offset). layer: buf is [R, B, S, ...] and x goes to buf[layer]."""
    zero = jnp.zeros((), jnp.int32)  # indices of one dtype, whatever jax_enable_x64 says
    start = jnp.asarray(start, jnp.int32)
    rest = (zero,) * (x.ndim - 2)
    if layer is not None:
        return _write_stack(buf, x, start, jnp.asarray(layer, jnp.int32))
    buf = constrain(buf, axes)
    if start.ndim == 0:
        return jax.lax.dynamic_update_slice(buf, constrain(x.astype(buf.dtype), axes), (zero, start, *rest))
    return jax.vmap(lambda b, x, s: jax.lax.dynamic_update_slice(b, x.astype(b.dtype), (s, *rest)))(buf, x, start)


def _write_stack(buf: jax.Array, x: jax.Array, start: jax.Array, layer: jax.Array) -> jax.Array:
    """write_cache into repeat `layer` of a stack [R, B, S, ...]. The stack
    keeps its layout (a scan's carry keeps its type): x takes it. One
    scatter into the stack as it lies (a vmap over its rows, its second
    axis, would transpose the whole stack twice), each row's start clamped
    as dynamic_update_slice clamps it."""
    x = as_repeat_of(x, buf)
    b, t = x.shape[:2]
    start = jnp.clip(jnp.broadcast_to(start, (b,)), 0, buf.shape[2] - t)
    return buf.at[layer, jnp.arange(b)[:, None], start[:, None] + jnp.arange(t)].set(x.astype(buf.dtype))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, cache: KVCache | KVStack | None,
           start: jax.Array | int, segments: jax.Array | None = None, kernel: Splash | None = None,
           ) -> tuple[jax.Array, KVCache | KVStack | None]:
    """q [B, T, H, D] over k, v [B, T, Hkv, D] at `positions` [T] (or [B, T]
    with a start per row), each query within its document when segments
    [B, T] are given. With a cache, k and v are written at [start,
    start + T) (start a scalar, or [B]: each row's own) and the queries see
    everything before them. kernel: the splash kernel for a whole sequence
    without a cache, where it takes the operands (Splash.runs). Returns
    (out [B, T, H, D], new cache or None)."""
    if cache is None and kernel is not None and kernel.runs(q, k, positions):
        return kernel(q, k, v, segments), None
    if cache is None:
        # Under a context axis each shard keeps its queries and gathers every
        # key and value (causal_attention; the mask hides the later ones):
        # simple, and full attention is one layer in four.
        return causal_attention(q, k, v, positions, positions, segments), None
    # on a mesh the cache keeps its length whole (writes land at any offset)
    axes = ("batch", None, "kv_heads", None)
    layer = cache.layer if isinstance(cache, KVStack) else None
    cache = cache._replace(k=write_cache(cache.k, k, start, axes, layer), v=write_cache(cache.v, v, start, axes, layer))
    keys, values = cache.k, cache.v
    if layer is not None:
        keys, values = (jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False) for a in (keys, values))
    slots = jnp.arange(keys.shape[1], dtype=positions.dtype)
    return causal_attention(q, keys.astype(q.dtype), values.astype(q.dtype), positions, slots), cache


# a ring slot that holds no position yet: later than any query, so never visible
EMPTY_SLOT = 2 ** 30


class RingCache(NamedTuple):
    """A sliding-window layer's keys and values [B, ring, Hkv, D]: position p
    at slot p % ring, the last `ring` positions seen (ring >= the window,
    plus the speculative tokens a verify pass may take back); fresh: the
    call's own keys and values [B, T, Hkv, D] when the caller asked for them
    (what a prefix cache keeps per block), else None."""
    k: jax.Array
    v: jax.Array
    fresh: tuple[jax.Array, jax.Array] | None = None

    @property
    def ring(self) -> int:
        return self.k.shape[-3]


def ring_positions(length: jax.Array, ring: int) -> jax.Array:
    """The position each slot holds once `length` tokens (a scalar or [B])
    went through a ring of `ring` slots: [ring] or [B, ring]; EMPTY_SLOT
    where none has yet."""
    last = jnp.asarray(length, jnp.int32)[..., None] - 1
    pos = last - jnp.mod(last - jnp.arange(ring, dtype=jnp.int32), ring)
    return jnp.where(pos < 0, EMPTY_SLOT, pos)


def attend_window(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, cache: RingCache | None,
                  start: jax.Array | int, window: int, segments: jax.Array | None = None,
                  lengths: jax.Array | None = None, keep_fresh: bool = False,
                  ) -> tuple[jax.Array, RingCache | None]:
    """As `attend`, each query seeing the `window` positions up to its own,
    with a RingCache: the queries see the ring's positions (before this
    call) and the call's keys; then the call's last real keys (before
    lengths [B], when given) are written at their slots. keep_fresh: the new
    cache carries the call's keys and values (RingCache.fresh)."""
    if cache is None:
        return causal_attention(q, k, v, positions, positions, segments, window), None
    b, t = k.shape[:2]
    ring = cache.ring
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
    old = ring_positions(start, ring)                                          # [B, ring]
    own = jnp.broadcast_to(positions.reshape(-1, t), (b, t))
    # on a mesh the ring and the call's keys take one placement: the ring
    # keeps its length whole (writes land at any slot)
    axes = ("batch", None, "kv_heads", None)
    k, v = constrain(k, axes), constrain(v, axes)
    keys = jnp.concatenate([constrain(cache.k.astype(q.dtype), axes), k], axis=1)
    values = jnp.concatenate([constrain(cache.v.astype(q.dtype), axes), v], axis=1)
    out = causal_attention(q, keys, values, positions, jnp.concatenate([old, own], axis=1), None, window)
    real = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
    index = jnp.arange(t, dtype=jnp.int32)
    written = (index[None] < real[:, None]) & (index[None] >= real[:, None] - ring)
    slots = jnp.where(written, jnp.mod(start[:, None] + index[None], ring), ring)  # ring: dropped

    def write(buf, x):
        return jax.vmap(lambda r, s, y: r.at[s].set(y.astype(r.dtype), mode="drop"))(buf, slots, x)
    return out, RingCache(write(constrain(cache.k, axes), k), write(constrain(cache.v, axes), v),
                          (k, v) if keep_fresh else None)


Rope = tuple[jax.Array, jax.Array] | None  # (cos, sin) [B or 1, T, rotary_dim], or None: no rotary embedding


def maybe_rope(x: jax.Array, rope: Rope) -> jax.Array:
    return x if rope is None else apply_rope(x, *rope)


class GatedAttention(nnx.Module):
    """Softmax attention with grouped key/value heads, q/k RMSNorm, partial
    RoPE and a sigmoid output gate."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 norm_eps: float, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 kernel: Splash | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kernel = kernel  # splash for whole sequences (gdnx.layers.splash), or None
        h, d, std = hidden_size, head_dim, init_std
        self.q_proj = linear(h, self.num_heads * d * 2, dtype, param_dtype, std, rngs, bias=bias)
        self.k_proj = linear(h, self.num_kv_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.v_proj = linear(h, self.num_kv_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.o_proj = linear(self.num_heads * d, h, dtype, param_dtype, std, rngs, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(d, eps=norm_eps, param_dtype=param_dtype)
        self.k_norm = ZeroCenteredRMSNorm(d, eps=norm_eps, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, rope: Rope, positions: jax.Array, cache: KVCache | KVStack | None = None,
                 start: jax.Array | int = 0, segments: jax.Array | None = None,
                 ) -> tuple[jax.Array, KVCache | KVStack | None]:
        """x [B, T, hidden]; rope for each token's position in its document;
        positions [T] (start + arange(T)) or [B, T]; the cache and segments as
        `attend` takes them. Returns (y, new cache or None)."""
        b, t, _ = x.shape
        d = self.head_dim
        qg = constrain(self.q_proj(x).reshape(b, t, self.num_heads, 2 * d), ("batch", "length", "heads", None))
        q, gate = qg[..., :d], qg[..., d:].reshape(b, t, self.num_heads * d)
        q = maybe_rope(self.q_norm(q), rope)
        k = maybe_rope(self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, d)), rope)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, d)
        out, cache = attend(q, k, v, positions, cache, start, segments, self.kernel)
        out = out.reshape(b, t, self.num_heads * d) * jax.nn.sigmoid(gate)
        return self.o_proj(out, out_sharding=out_sharding(HIDDEN, x.shape)), cache


class NormedAttention(nnx.Module):
    """Softmax attention with grouped key/value heads, RMSNorm on q and on k
    across all their heads (before splitting into heads), RoPE or none."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 norm_eps: float, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 kernel: Splash | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kernel = kernel  # splash for whole sequences (gdnx.layers.splash), or None
        h, d, std = hidden_size, head_dim, init_std
        self.q_proj = linear(h, self.num_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.k_proj = linear(h, self.num_kv_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.v_proj = linear(h, self.num_kv_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.o_proj = linear(self.num_heads * d, h, dtype, param_dtype, std, rngs, bias=bias)
        self.q_norm = RMSNorm(self.num_heads * d, eps=norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(self.num_kv_heads * d, eps=norm_eps, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, rope: Rope, positions: jax.Array, cache: KVCache | KVStack | None = None,
                 start: jax.Array | int = 0, segments: jax.Array | None = None,
                 ) -> tuple[jax.Array, KVCache | KVStack | None]:
        """As GatedAttention.__call__."""
        b, t, _ = x.shape
        d = self.head_dim
        q = maybe_rope(self.q_norm(self.q_proj(x)).reshape(b, t, self.num_heads, d), rope)
        k = maybe_rope(self.k_norm(self.k_proj(x)).reshape(b, t, self.num_kv_heads, d), rope)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, d)
        out, cache = attend(q, k, v, positions, cache, start, segments, self.kernel)
        return self.o_proj(out.reshape(b, t, self.num_heads * d), out_sharding=out_sharding(HIDDEN, x.shape)), cache


class HeadNormedAttention(nnx.Module):
    """Softmax attention with grouped key/value heads, RMSNorm on q and on k
    per head, no gate, RoPE or none (per call), and a sliding window or
    none."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 norm_eps: float, window: int | None, init_std: float, dtype: DTypeLike, param_dtype: DTypeLike,
                 rngs: nnx.Rngs, kernel: Splash | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        self.kernel = kernel  # splash for whole sequences without a window, or None
        h, d, std = hidden_size, head_dim, init_std
        self.q_proj = linear(h, self.num_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.k_proj = linear(h, self.num_kv_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.v_proj = linear(h, self.num_kv_heads * d, dtype, param_dtype, std, rngs, bias=bias)
        self.o_proj = linear(self.num_heads * d, h, dtype, param_dtype, std, rngs, bias=bias)
        self.q_norm = RMSNorm(d, eps=norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(d, eps=norm_eps, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, rope: Rope, positions: jax.Array,
                 cache: KVCache | KVStack | RingCache | None = None, start: jax.Array | int = 0,
                 segments: jax.Array | None = None, lengths: jax.Array | None = None,
                 keep_fresh: bool = False) -> tuple[jax.Array, KVCache | KVStack | RingCache | None]:
        """As GatedAttention.__call__; a windowed layer takes a RingCache, and
        lengths and keep_fresh as attend_window does."""
        b, t, _ = x.shape
        d = self.head_dim
        q = maybe_rope(self.q_norm(constrain(self.q_proj(x).reshape(b, t, self.num_heads, d),
                                        ("batch", "length", "heads", None))), rope)
        k = maybe_rope(self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, d)), rope)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, d)
        if self.window is None:
            assert cache is None or isinstance(cache, KVCache)  # the model builds the cache per layer
            out, new = attend(q, k, v, positions, cache, start, segments, self.kernel)
            cache = new
        else:
            assert cache is None or isinstance(cache, RingCache)
            out, ring = attend_window(q, k, v, positions, cache, start, self.window, segments, lengths, keep_fresh)
            cache = ring
        return self.o_proj(out.reshape(b, t, self.num_heads * d), out_sharding=out_sharding(HIDDEN, x.shape)), cache
