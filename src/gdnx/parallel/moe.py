"""The routed experts under jax.shard_map.

Routing is per token, so each batch / sequence shard routes and runs its
own tokens: no global sort, no token exchange. Every shard holds all experts
with the expert width split over tensor (gathered from fsdp); the down
projections' partial sums meet in a psum over tensor, and the routing
counts in a psum over the token axes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from gdnx.parallel.rules import current_mesh, is_explicit, mesh_axes, spec

TOKENS = ("batch", "length", None)  # x [B, T, hidden], top-k ids / weights [B, T, k]


def run_experts(local: Callable, x: jax.Array, top_p: jax.Array, top_i: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, *, kernels: bool = False) -> jax.Array:
    """local(x, top_p, top_i, w_gate, w_up, w_down, width_axes, token_axes)
    -> (y [B, T, hidden], counts [E]) on each shard; width_axes / token_axes
    name the mesh axes to psum the partial outputs / counts over. kernels:
    local runs Pallas kernels, whose outputs carry no varying-axes
    information (the shard_map then checks none)."""
    mesh = current_mesh()
    if mesh is None:
        return local(x, top_p, top_i, w_gate, w_up, w_down, (), ())
    tok = spec(TOKENS, x.shape, mesh=mesh)
    gate_up = spec((None, None, "mlp"), w_gate.shape, mesh=mesh)
    down = P(None, gate_up[2], None)
    specs = (tok, P(*tok[:2], None), P(*tok[:2], None), gate_up, gate_up, down)
    args = (x, top_p, top_i, w_gate, w_up, w_down)
    if is_explicit(mesh):
        args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, specs, strict=True))
    width_axes, token_axes = mesh_axes(gate_up[2]), mesh_axes(*tok[:2])

    def body(*xs):
        return local(*xs, width_axes, token_axes)

    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=not kernels)(*args)
