"""The GDN ops (conv1d and delta rule) under jax.shard_map.

Specs come from the logical rules: batch over data/fsdp, key heads over
tensor (each key head's conv channels, value heads, gates and states move
with it, so the ops see whole groups), and the sequence over context, where
the context-parallel versions of the ops take over. Under an Explicit mesh,
shard_map does not insert the resharding a Pallas kernel's layout needs, so
every input is resharded to its spec first. The kernels' pallas_call carries
no varying-axes information, hence check_vma=False.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from gdnx.ops.delta_rule.decode_step import StateStack
from gdnx.parallel.rules import axis_size, current_mesh, is_explicit, spec

# logical axes of the core's operands (layout in layers/gated_deltanet.py); every
# operand's spec follows from MIXED's: the same batch, length and head entries
MIXED = ("batch", "length", "key_heads", None)             # [B, T, HK, dk + dk + G dv]
GATE = ("batch", "length", "value_heads")                   # g (GDN), beta [B, T, HV]; KDA's g [B, T, HV, K]
OUT = ("batch", "length", "value_heads", None)              # [B, T, HV, V]


def run_gdn_core(core: Callable, mixed: jax.Array, conv_weight: jax.Array, g: jax.Array, beta: jax.Array,
                 conv_state: jax.Array | None, state: jax.Array | StateStack | None, starts: jax.Array | None = None,
                 lengths: jax.Array | None = None, *, num_key_heads: int, kernel_size: int,
                 history: bool = False) -> tuple[jax.Array, jax.Array | None, jax.Array | None, Any]:
    """core(mixed, conv_weight, g, beta, conv_state, state, context_axis,
    starts, lengths) -> (o, conv_state, state, history), run on each shard
    of the ambient mesh (directly when there is none). g: GDN's [B, T, HV]
    or KDA's [B, T, HV, K]. conv_weight [HK, ., W], conv_state
    [B, HK, ., W - 1] and state [B, HV, K, V] (or a scanned cycle's
    StateStack) may be None (in and out);
    starts [B, T] (packed documents' first tokens) and lengths [B] (each
    row's real tokens) may be None. history: core returns a state history
    (two arrays [B, N, heads, ...], returned as a tuple on a mesh), else
    None."""
    mesh = current_mesh()
    if mesh is None:
        return core(mixed, conv_weight, g, beta, conv_state, state, None, starts, lengths)
    rows, context, heads, _ = spec(MIXED, mixed.shape, units={"key_heads": num_key_heads}, mesh=mesh)
    if context is not None and mixed.shape[1] // axis_size(context, mesh) < kernel_size - 1:
        context = None  # a shard must hold the next shard's conv halo
    # value heads split with their key heads: the same entry serves both
    gate, out, states = P(rows, context, heads), P(rows, context, heads, None), P(rows, heads, None, None)
    args: tuple = (mixed, conv_weight, g, beta, conv_state, state, starts, lengths)
    # a scanned cycle's stack of states: every repeat's, this shard's rows and heads; the index whole
    held = StateStack._make((P(None, *states), P())) if isinstance(state, StateStack) else states
    specs = (P(rows, context, heads, None), P(heads, None, None), gate if g.ndim == 3 else out, gate,
             None if conv_state is None else states, None if state is None else held,
             None if starts is None else P(rows, context), None if lengths is None else P(rows))
    if is_explicit(mesh):
        args = tuple(a if a is None else jax.sharding.reshard(a, s) for a, s in zip(args, specs, strict=True))
    along = P(rows, None, heads, None, None)  # a history: per row, per snapshot, per head

    def local(*xs):
        o, conv, rec, hist = core(*xs[:6], context, *xs[6:])
        return (o, conv, rec, (hist.conv, hist.recurrent)) if history else (o, conv, rec)

    outs = jax.shard_map(local, mesh=mesh, in_specs=specs,
                         out_specs=(out, specs[4], specs[5], *([(along, along)] if history else [])),
                         check_vma=False)(*args)
    return (*outs, None) if not history else tuple(outs)
