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

import jax

from gdnx.parallel.rules import axis_size, current_mesh, is_explicit, spec

# logical axes of the core's operands and results (layout in layers/gated_deltanet.py)
MIXED = ("batch", "length", "key_heads", None)             # [B, T, HK, dk + dk + G dv]
CONV_WEIGHT = ("key_heads", None, None)                     # [HK, dk + dk + G dv, W]
GATE = ("batch", "length", "value_heads")                   # g, beta [B, T, HV]
CONV_STATE = ("batch", "key_heads", None, None)             # [B, HK, dk + dk + G dv, W - 1]
STATE = ("batch", "value_heads", None, None)                # [B, HV, K, V]
OUT = ("batch", "length", "value_heads", None)              # [B, T, HV, V]


def run_gdn_core(core: Callable, mixed, conv_weight, g, beta, conv_state, state, *, num_key_heads: int,
                 kernel_size: int):
    """core(mixed, conv_weight, g, beta, conv_state, state, context_axis) ->
    (o, conv_state, state), run on each shard of the ambient mesh (directly
    when there is none). States may be None (in and out)."""
    mesh = current_mesh()
    if mesh is None:
        return core(mixed, conv_weight, g, beta, conv_state, state, None)
    units = {"key_heads": num_key_heads, "value_heads": num_key_heads}
    t = mixed.shape[1]
    mixed_spec = spec(MIXED, mixed.shape, units=units, mesh=mesh)
    context = mixed_spec[1]
    if context is not None and t // axis_size(context, mesh) < kernel_size - 1:
        context = None  # a shard must hold the next shard's conv halo
    mixed_spec = spec(MIXED[:1] + (MIXED[1] if context else None,) + MIXED[2:], mixed.shape, units=units, mesh=mesh)
    gate_spec = spec(GATE[:1] + (GATE[1] if context else None,) + GATE[2:], g.shape, units=units, mesh=mesh)
    args = (mixed, conv_weight, g, beta, conv_state, state)
    specs = (mixed_spec, spec(CONV_WEIGHT, conv_weight.shape, units=units, mesh=mesh), gate_spec, gate_spec,
             None if conv_state is None else spec(CONV_STATE, conv_state.shape, units=units, mesh=mesh),
             None if state is None else spec(STATE, state.shape, units=units, mesh=mesh))
    if is_explicit(mesh):
        args = tuple(a if a is None else jax.sharding.reshard(a, s) for a, s in zip(args, specs, strict=True))
    out_spec = jax.sharding.PartitionSpec(*mixed_spec[:3], None)

    def local(*xs):
        return core(*xs, context)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(out_spec, specs[4], specs[5]),
                         check_vma=False)(*args)

