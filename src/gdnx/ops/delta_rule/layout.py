"""Where each token sits when a sequence is cut into chunks.

Every implementation walks rows of chunks. A plain batch is B rows of
ceil(T / C) chunks, zero-padded at the end. Packed sequences (cu_seqlens, one
row) are re-laid so that each sequence starts on a chunk boundary and no chunk
mixes two sequences; with C = 1 the same plan drives the token recurrence.

Zero padding is inert: a padded token has k = v = q = 0, gate 0 (no decay)
and beta 0, so it leaves the state unchanged and its output is discarded.

Per chunk and row the plan carries three flags:
    reset  the chunk starts a sequence: its incoming state is h0[seq]
    seq    which sequence the chunk belongs to
    last   the chunk ends its sequence: its outgoing state is final[seq]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    rows: int
    length: int
    chunk: int
    num_chunks: int
    num_seqs: int
    reset: jax.Array      # [NC, R] bool
    seq: jax.Array        # [NC, R] int32
    last: jax.Array       # [NC, R] bool
    nonempty: jax.Array   # [N] bool; an empty sequence's final state is h0
    gather: jax.Array | None = None   # [NC*C] source token of each slot (packed)
    valid: jax.Array | None = None    # [NC*C] slot holds a real token (packed)
    scatter: jax.Array | None = None  # [T] slot of each token (packed)

    @property
    def padded_length(self) -> int:
        return self.num_chunks * self.chunk


def make_plan(rows: int, length: int, chunk: int, cu_seqlens: jax.Array | None = None) -> ChunkPlan:
    if cu_seqlens is None:
        nc = -(-length // chunk)
        c = jnp.arange(nc)[:, None]
        shape = (nc, rows)
        return ChunkPlan(
            rows=rows, length=length, chunk=chunk, num_chunks=nc, num_seqs=rows,
            reset=jnp.broadcast_to(c == 0, shape),
            seq=jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[None, :], shape),
            last=jnp.broadcast_to(c == nc - 1, shape),
            nonempty=jnp.ones((rows,), bool),
        )

    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    n = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + chunk - 1) // chunk
    cstart = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch)[:-1].astype(jnp.int32)])
    # sum ceil(L_n / C) <= (T + N (C - 1)) / C: a static bound on the chunks.
    nc = max(1, (length + n * (chunk - 1)) // chunk)
    slot = jnp.arange(nc * chunk, dtype=jnp.int32)
    # side="right" skips empty sequences that share a start with the next one.
    slot_seq = jnp.searchsorted(cstart * chunk, slot, side="right").astype(jnp.int32) - 1
    offset = slot - cstart[slot_seq] * chunk
    valid = offset < lens[slot_seq]
    gather = jnp.where(valid, cu[slot_seq] + offset, 0)
    tok = jnp.arange(length, dtype=jnp.int32)
    tok_seq = jnp.searchsorted(cu, tok, side="right").astype(jnp.int32) - 1
    scatter = cstart[tok_seq] * chunk + tok - cu[tok_seq]

    cseq = slot_seq[::chunk]
    coff = offset[::chunk]
    real = lens[cseq] > 0
    cidx = jnp.arange(nc, dtype=jnp.int32)
    return ChunkPlan(
        rows=1, length=length, chunk=chunk, num_chunks=nc, num_seqs=n,
        reset=((coff == 0) & real)[:, None],
        seq=cseq[:, None],
        last=((cidx == cstart[cseq] + nch[cseq] - 1) & real)[:, None],
        nonempty=lens > 0,
        gather=gather, valid=valid, scatter=scatter,
    )


def to_slots(x: jax.Array, plan: ChunkPlan) -> jax.Array:
    """[R, T, ...] -> [R, NC*C, ...], zero in padding slots."""
    if plan.gather is None:
        pad = [(0, 0), (0, plan.padded_length - plan.length)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, pad)
    assert plan.valid is not None  # a packed plan has both
    y = jnp.take(x, plan.gather, axis=1)
    mask = plan.valid.reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.where(mask, y, jnp.zeros((), x.dtype))


def from_slots(y: jax.Array, plan: ChunkPlan) -> jax.Array:
    """[R, NC*C, ...] -> [R, T, ...]."""
    if plan.scatter is None:
        return y[:, :plan.length]
    return jnp.take(y, plan.scatter, axis=1)
