"""The routed experts under jax.shard_map.

Routing is per token, so each batch / sequence shard routes and runs its
own tokens: no global sort, no token exchange. The tensor axis splits the
experts one of two ways (`split_experts`): each device holds every expert
with a slice of its width (the down projections' partial sums meet in a
psum over tensor), or whole experts, a share of them, and runs the token
copies routed to its own (the tokens are the same on every device of the
tensor axis, so the outputs meet in the same psum; no all-to-all). The
routing counts meet in a psum over the token axes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from gdnx.parallel.rules import current_mesh, is_explicit, mesh_axes, spec

TOKENS = ("batch", "length", None)  # x [B, T, hidden], top-k ids / weights [B, T, k]
LANES = 128  # a TPU vector register's lanes: a narrower width slice is padded to it in every copy XLA makes


def split_experts(choice: str, num_experts: int, expert_size: int, mesh: Mesh | AbstractMesh | None = None,
                  ) -> bool:
    """Whether the tensor axis of `mesh` (the ambient one by default) splits
    the routed experts by expert rather than by width. choice: the config's
    moe_split (auto, width or experts). experts on an axis that does not
    divide the experts is a ValueError naming both numbers."""
    mesh = mesh or current_mesh()
    tensor = dict(mesh.shape).get("tensor", 1) if mesh is not None else 1
    if tensor == 1 or choice == "width":
        return False
    if choice == "experts":
        if num_experts % tensor:
            raise ValueError(f"model.moe_split: experts needs the tensor axis ({tensor}) to divide num_experts "
                             f"({num_experts})")
        return True
    return num_experts % tensor == 0 and (expert_size % tensor != 0 or (expert_size // tensor) % LANES != 0)


def expert_axes(split: bool) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """The logical axes of the experts' gate/up [E, hidden, width] and down
    [E, width, hidden] weights, split by expert or by width."""
    if split:
        return ("experts", "embed", None), ("experts", None, "embed")
    return (None, "embed", "mlp"), (None, "mlp", "embed")


def run_experts(local: Callable, x: jax.Array, top_p: jax.Array, top_i: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, *, split: bool = False, kernels: bool = False) -> jax.Array:
    """local(x, top_p, top_i, w_gate, w_up, w_down, sum_axes, expert_axes,
    token_axes) -> (y [B, T, hidden], counts [E]) on each shard: sum_axes
    name the mesh axes to psum the partial outputs over, expert_axes those
    whole experts are split over (the shard holds experts [i E/n, (i+1)
    E/n)), token_axes those to psum the counts over. split: whole experts
    over tensor (split_experts). kernels: local runs Pallas kernels, whose
    outputs carry no varying-axes information (the shard_map then checks
    none)."""
    mesh = current_mesh()
    if mesh is None:
        return local(x, top_p, top_i, w_gate, w_up, w_down, (), (), ())
    tok = spec(TOKENS, x.shape, mesh=mesh)
    # the weights without their fsdp split (gathered for the products)
    gate_up_axes, down_axes = (tuple(None if a == "embed" else a for a in axes) for axes in expert_axes(split))
    gate_up, down = spec(gate_up_axes, w_gate.shape, mesh=mesh), spec(down_axes, w_down.shape, mesh=mesh)
    specs = (tok, P(*tok[:2], None), P(*tok[:2], None), gate_up, gate_up, down)
    args = (x, top_p, top_i, w_gate, w_up, w_down)
    if is_explicit(mesh):
        args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, specs, strict=True))
    experts = mesh_axes(gate_up[0])
    sums, token_axes = experts + mesh_axes(gate_up[2]), mesh_axes(*tok[:2])

    def body(*xs):
        return local(*xs, sums, experts, token_axes)

    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, P()), check_vma=not kernels)(*args)
