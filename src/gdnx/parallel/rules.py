"""Logical axis rules: names for the dims of parameters and activations, and
the mesh axes each name is split over.

The model never names a mesh axis. It names what a dim holds ("batch",
"length", "key_heads", ...) and asks for the spec on the ambient mesh
(`jax.set_mesh`). A mesh axis that does not divide a dim, or that the mesh
lacks, is dropped from that dim's spec instead of failing: a microbatch of
2 on a data axis of 8 runs replicated over that axis. Without a mesh every
helper here is the identity, so single-device code pays nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")

# logical name -> mesh axes, in order of preference (later axes are dropped first)
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),  # expert: a data axis outside the routed experts
    "length": ("context",),
    "hidden": (),            # the model width of activations stays whole
    "embed": ("fsdp",),      # ... and of parameters is split for FSDP
    "vocab": ("tensor",),
    # the rows of Qwen4-Exp's n-gram tables (~41B parameters per layer): over every axis that splits parameters;
    # a lookup gathers locally and sums the rows over the mesh, the table never moves
    "ngram_rows": ("fsdp", "tensor", "expert"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "key_heads": ("tensor",),    # GDN key heads; a key head's value heads go with it
    "value_heads": ("tensor",),
    "mlp": ("tensor",),
    # the routed experts' dim: over expert when tensor splits their width, over both when it splits whole experts
    # (gdnx.parallel.moe.split_experts)
    "routed": ("expert",),
    "experts": ("expert", "tensor"),
    "layers": (),            # the repeats of a scanned stack: every device holds its share of each layer
}


def current_mesh() -> Mesh | AbstractMesh | None:
    """The ambient abstract mesh when it has any of gdnx's axes, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) & set(mesh.axis_names):
        return None
    if any(t == AxisType.Manual for t in mesh.axis_types):
        return None  # inside shard_map: values are per-shard, nothing to place
    return mesh


def is_explicit(mesh: Mesh | AbstractMesh) -> bool:
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def spec(axes: Sequence[str | None], shape: Sequence[int], *, units: dict[str, int] | None = None,
         mesh: Mesh | AbstractMesh | None = None) -> P:
    """PartitionSpec for a value of `shape` whose dims hold the logical `axes`.

    units: for dims made of whole groups (the columns of a key head), the
    number of groups, which is what a mesh axis must divide."""
    mesh = mesh or current_mesh()
    if mesh is None:
        return P(*([None] * len(shape)))
    sizes = dict(mesh.shape)
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape, strict=True):
        count = (units or {}).get(name, dim) if name else dim
        kept: list[str] = []
        for axis in RULES[name] if name else ():
            size = sizes.get(axis, 1)
            if size == 1 or axis in used or count % (math.prod(sizes[a] for a in kept) * size):
                continue
            kept.append(axis)
        used.update(kept)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*out)


def mesh_axes(*entries: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axis names in these PartitionSpec entries (None, a name, or
    a tuple of names)."""
    out: list[str] = []
    for e in entries:
        if e is not None:
            out.extend((e,) if isinstance(e, str) else e)
    return tuple(out)


def axis_size(spec_entry: str | tuple[str, ...] | None, mesh: Mesh | AbstractMesh) -> int:
    sizes = dict(mesh.shape)
    return math.prod(sizes[n] for n in mesh_axes(spec_entry))


def constrain(x: jax.Array, axes: Sequence[str | None], *, units: dict[str, int] | None = None) -> jax.Array:
    """Place x per its logical axes: jax.sharding.reshard on an Explicit mesh,
    a sharding constraint on an Auto one, nothing without a mesh."""
    mesh = current_mesh()
    if mesh is None:
        return x
    s = spec(axes, x.shape, units=units, mesh=mesh)
    if is_explicit(mesh):
        return jax.sharding.reshard(x, s)
    return jax.lax.with_sharding_constraint(x, s)


def out_sharding(axes: Sequence[str | None], shape: Sequence[int], *, units: dict[str, int] | None = None,
                 ) -> P | None:
    """The `out_sharding` argument for an op whose result has these logical
    axes: a spec on an Explicit mesh (where jax cannot always infer one),
    None otherwise. axes may name the trailing dims only."""
    axes = tuple(axes)[-len(shape):] if len(axes) > len(shape) else tuple(axes)
    mesh = current_mesh()
    if mesh is None or not is_explicit(mesh):
        return None
    return spec(axes, shape, units=units, mesh=mesh)

HIDDEN = ("batch", "length", "hidden")  # the residual stream [B, T, hidden]


def as_layout_of(x: jax.Array, like: jax.Array) -> jax.Array:
    """x laid out as `like` on an Explicit mesh (where a scan's carry must
    keep its layout); as it is elsewhere."""
    mesh = current_mesh()
    if mesh is None or not is_explicit(mesh):
        return x
    return jax.sharding.reshard(x, jax.typeof(like).sharding.spec)


def as_repeat_of(x: jax.Array, stack: jax.Array) -> jax.Array:
    """x laid out as one repeat (along the first axis) of `stack` on an
    Explicit mesh, where the two must agree to be written together; as it
    is elsewhere."""
    mesh = current_mesh()
    if mesh is None or not is_explicit(mesh):
        return x
    return jax.sharding.reshard(x, P(*jax.typeof(stack).sharding.spec[1:]))
